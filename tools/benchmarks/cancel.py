"""The time from a cancel to the replica's next job: how soon a cancelled running job gives its replica back.

For each configuration, servers are started (`runtime serve`) and made ready; then, --repeats times: a long job
(--steps steps) is queued and runs, a short one waits behind it; once the long one has made progress, POST
/v1/videos/{id}/cancel is sent (to the replica that is not running it, where there are two), and the time from the
cancel's answer to the short job's `in_progress` (polled every 5 ms) is taken, with the steps the cancelled job ran
after the cancel (its replica's log). Beside it, the step time of the long job (the replica's wan_aot_step_seconds):
the bound is about one step, plus a claim (the worker looks for work at once when a job ends) and the poll.

Configurations: one server on its SQLite queue; two replicas on one PostgreSQL queue (Debian's PostgreSQL, started
in a temporary directory, as in benchmarks/serve.py), the cancel sent through the other replica. Everything listens on
127.0.0.1; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from .common import WORKLOADS, Report, Table, add_common, bundle, log, median, num
from .serve import Postgres, start_replica, wait_ready


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=5, devices=("cpu",), workloads=("tiny",), dtypes=("fp32",))
    p.add_argument("--steps", type=int, default=1000, help="steps of the job that is cancelled (default 1000)")


def _call(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def _until(url: str, video_id: str, ok: Any, timeout: float = 600, every: float = 0.005) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = _call(f"{url}/v1/videos/{video_id}")
        if ok(job):
            return job
        time.sleep(every)
    raise SystemExit(f"error: {video_id} did not reach the state asked for in {timeout} s")


def _step_seconds(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = float(re.search(r"^wan_aot_step_seconds_sum ([0-9.e+-]+)$", text, re.M)[1])
    count = float(re.search(r"^wan_aot_step_seconds_count ([0-9.e+-]+)$", text, re.M)[1])
    return total, count


def one(urls: list[str], logs: list[Path], steps: int) -> dict[str, float]:
    long = _call(f"{urls[0]}/v1/videos", "POST", {"prompt": "a long job, cancelled", "num_inference_steps": steps})
    short = _call(f"{urls[0]}/v1/videos", "POST", {"prompt": "the next job", "num_inference_steps": 2})
    _until(urls[0], long["id"], lambda j: j["status"] == "in_progress" and j["progress"] >= 2)
    runner = next(i for i, p in enumerate(logs) if f"job {long['id']}: started" in p.read_text())
    other = urls[(runner + 1) % len(urls)]
    before = _step_seconds(urls[runner])
    t = time.perf_counter()
    at_cancel = _call(f"{other}/v1/videos/{long['id']}/cancel", "POST", {})
    answered = time.perf_counter()
    _until(urls[0], short["id"], lambda j: j["status"] in ("in_progress", "completed"))
    started = time.perf_counter()
    _until(urls[0], short["id"], lambda j: j["status"] in ("completed", "failed"), every=0.05)
    match = None
    deadline = time.time() + 60
    while match is None and time.time() < deadline:
        match = re.search(rf"job {long['id']}: cancelled by a client; stopped after (\d+) denoising steps",
                          logs[runner].read_text())
        time.sleep(0.02)
    after = _step_seconds(urls[runner])
    step = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    ran = int(match[1]) if match else -1
    return {"cancel_to_next_job_s": started - answered, "cancel_answer_s": answered - t, "step_s": step,
            "steps_at_cancel_floor": 10 * at_cancel["progress"] * steps / 1000, "steps_run": ran}


def run(a: argparse.Namespace) -> Report:
    wl = WORKLOADS[a.workload[0]]
    bund = bundle(a.work, wl, a.dtype[0], a.device)
    work = a.work / "cancel"
    work.mkdir(parents=True, exist_ok=True)
    stamp = int(time.time())
    pg = Postgres()
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        for name, replicas, postgres in (("1 server, SQLite", 1, False), ("2 replicas, PostgreSQL", 2, True)):
            queue = pg.database(f"cancel_{stamp}") if postgres else None
            jobs = work / f"{stamp}-{replicas}" / "jobs"
            jobs.mkdir(parents=True)
            logs = [work / f"{stamp}-{replicas}-{i}.log" for i in range(replicas)]
            procs = [start_replica(bund, queue, jobs, logfile) for logfile in logs]
            try:
                for proc, url in procs:
                    wait_ready(url, proc)
                runs[name] = [one([u for _, u in procs], logs, a.steps) for _ in range(a.repeats)]
                log(f"{name}: {a.repeats} cancels")
            finally:
                for proc, _ in procs:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
    finally:
        pg.stop()
    t = Table(f"{a.workload[0]}, {a.dtype[0]} ({wl.shape}; {a.device}): a running {a.steps}-step job cancelled, the "
              f"next job waiting (medians of {a.repeats})",
              ["configuration", "cancel → next job in progress ms", "the cancel's answer ms", "one step ms",
               "steps run after the cancel's progress (max)"])
    for name, rs in runs.items():
        extra = max(r["steps_run"] - r["steps_at_cancel_floor"] for r in rs)
        t.add(name, num(median([r["cancel_to_next_job_s"] for r in rs]) * 1e3, 0),
              num(median([r["cancel_answer_s"] for r in rs]) * 1e3, 1), num(median([r["step_s"] for r in rs]) * 1e3, 1),
              f"{extra:.0f}")
    t.notes.append("The cancelled job's progress is a percentage, so the steps it had run at the cancel are known to "
                   "within steps/100: the last column counts from the lowest, and so can exceed 1 by that much.")
    return Report([t], runs)
