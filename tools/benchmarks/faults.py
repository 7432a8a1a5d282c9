"""Jobs under the faults of what the servers depend on (issue 61), in one run: a load of --requests jobs
(benchmarks/load.py: --clients clients, retrying 503s and 507s as a client does) while, --fault-after seconds in,

- the queue's PostgreSQL is stopped (`pg_ctl stop -m fast`) for --outage seconds and started again on its data
  directory, under two replicas (`--lease 5`);
- the disk under one replica's --jobs-dir (a tmpfs of its own; root only) is filled for --outage seconds;
- one replica's S3 store (moto on loopback, behind a TCP relay) cannot be reached for --store-outage seconds: once
  with the default --store-retry-seconds (300), once with `--store-retry-seconds 5` (shorter than the outage).

Per fault: jobs completed, failed (by error code), lost (accepted but never ended, or vanished) and completed twice,
out of --requests; and the seconds from the fault's end (the database started, the disk freed, the relay reopened) to
the next job completed, seen by polling the list every 0.1 s. Everything listens on 127.0.0.1; every process is stopped
at the end; their logs stay in WORK/faults-logs/. Exit 1 when a job was lost or completed twice.

    python tools/bench.py faults --requests 12 --steps 100 --outage 20 --store-outage 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import load
from .common import ROOT, WORKLOADS, Report, Table, Usage, add_common, bundle, child_env, log, num
from .serve import PG_BIN, Postgres, _as_postgres, _port, wait_ready

FAULTS = ("postgres", "disk", "store")
LOGS = ROOT / "artifacts" / "bench" / "faults-logs"  # set from --work in run()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=1, devices=("cpu",), workloads=("tiny",), dtypes=("fp32",))
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS), help="which faults (default: all)")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=100, help="steps per job: long enough that faults meet running jobs")
    p.add_argument("--fault-after", type=float, default=5.0, help="seconds into the load the fault starts")
    p.add_argument("--outage", type=float, default=20.0, help="seconds the database is down, the disk full")
    p.add_argument("--store-outage", type=float, default=10.0, help="seconds the S3 store cannot be reached")


def _serve(bund: Path, jobs: Path, logfile: str, *flags: str, env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen, str]:
    port = _port()
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / logfile, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bund), "--port", str(port),
                                 "--jobs-dir", str(jobs), "--queue-size", "64", *flags], cwd=ROOT,
                                env={**child_env(), **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _completed(url: str) -> int | None:
    """Completed jobs in the list, or None while the server cannot say (503: its database is away)."""
    try:
        with urllib.request.urlopen(url + "/v1/videos?limit=100", timeout=5) as r:
            return sum(v["status"] == "completed" for v in json.load(r)["data"])
    except OSError:
        return None


def _with_fault(a: argparse.Namespace, urls: list[str], start: Any, end: Any, outage: float) -> dict[str, Any]:
    """The load against `urls`; `start()` --fault-after s in, `end()` `outage` s later; the seconds from `end` to
    the next job completed (None if none completed after it)."""
    args = argparse.Namespace(urls=urls, clients=a.clients, requests=a.requests, steps=a.steps, timeout=900.0,
                              max_retries=600, poll_interval=0.25, api_key=None, repeats=1,
                              prompt="a red fox running through fresh snow", kill_pid=None, kill_after=None)
    out: dict[str, Any] = {}

    def fault() -> None:
        time.sleep(a.fault_after)
        before = max((_completed(u) or 0) for u in urls)
        start()
        log(f"fault started; {before} jobs completed before it")
        time.sleep(outage)
        end()
        back = time.monotonic()
        log("fault ended")
        while time.monotonic() - back < 600:
            counts = [c for c in map(_completed, urls) if c is not None]
            if counts and max(counts) > before:
                out["to_first_completed_s"] = time.monotonic() - back
                return
            if out.get("done"):
                return
            time.sleep(0.1)

    thread = threading.Thread(target=fault, daemon=True)
    thread.start()
    summary = load.load(args, load.check(args))
    out["done"] = True
    thread.join(660)
    return {**summary, "to_first_completed_s": out.get("to_first_completed_s"), "outage_s": outage}


def _stop(procs: list[tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def postgres_restart(a: argparse.Namespace, bund: Path, work: Path) -> dict[str, Any]:
    pg = Postgres()
    try:
        queue = pg.database(f"faults_{int(time.time())}")
        procs = [_serve(bund, work / "pg-jobs", f"pg-{i}.log", "--queue", queue, "--lease", "5")
                 for i in range(2)]
        try:
            for proc, url in procs:
                wait_ready(url, proc)
            data = str(pg.root / "data")

            def stop() -> None:
                subprocess.run(_as_postgres(str(PG_BIN / "pg_ctl"), "-D", data, "-m", "fast", "-w", "stop"),
                               check=True, capture_output=True)

            def start() -> None:
                subprocess.run(_as_postgres(str(PG_BIN / "pg_ctl"), "-D", data, "-o",
                                            f"-p {pg.port} -k {pg.root / 'sock'} -c listen_addresses=127.0.0.1", "-l",
                                            str(pg.root / "log"), "-w", "start"), check=True, capture_output=True)

            summary = _with_fault(a, [u for _, u in procs], stop, start, a.outage)
            summary["replicas_exited"] = sum(p.poll() is not None for p, _ in procs)
            import psycopg

            with psycopg.connect(queue) as conn:
                (summary["taken_over"],) = conn.execute("SELECT COUNT(*) FROM jobs WHERE attempts > 1").fetchone()
            return summary
        finally:
            _stop(procs)
    finally:
        pg.stop()


def disk_full(a: argparse.Namespace, bund: Path, work: Path) -> dict[str, Any] | str:
    jobs = work / "disk-jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(jobs)],
                          capture_output=True, text=True)
    if done.returncode:
        return f"skipped: cannot mount a tmpfs ({done.stderr.strip()})"
    try:
        procs = [_serve(bund, jobs, "disk.log")]
        filler = jobs / "filler"
        try:
            wait_ready(procs[0][1], procs[0][0])

            def fill() -> None:
                with open(filler, "wb") as f, contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()

            summary = _with_fault(a, [procs[0][1]], fill, lambda: filler.unlink(missing_ok=True), a.outage)
            summary["replicas_exited"] = sum(p.poll() is not None for p, _ in procs)
            return summary
        finally:
            _stop(procs)
    finally:
        subprocess.run(["umount", "-l", str(jobs)], check=False)


class Relay:
    """A TCP relay on a loopback port to `upstream`; `close()` refuses connections and cuts those open, `reopen()`
    listens again on the same port."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream, self.port, self.open = upstream, _port(), False
        self.sockets: set[socket.socket] = set()
        self.reopen()

    def reopen(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(64)
        self.open = True
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            self.sockets |= {client, server}
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            self.sockets.discard(s)

    def close(self) -> None:
        self.open = False
        self.listener.close()
        for s in list(self.sockets):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def store_outage(a: argparse.Namespace, bund: Path, work: Path, retry: float | None) -> dict[str, Any]:
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise Usage("the store fault needs moto and boto3 (the test requirements)") from None
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        bucket = f"faults{int(time.time())}"
        boto3.client("s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        relay = Relay((host, port))
        env = {"FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{relay.port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        flags = ["--videos-url", f"s3://{bucket}/v"] + (["--store-retry-seconds", f"{retry:g}"] if retry else [])
        procs = [_serve(bund, work / f"store-jobs-{retry}", f"store-{retry}.log", *flags, env=env)]
        try:
            wait_ready(procs[0][1], procs[0][0])
            summary = _with_fault(a, [procs[0][1]], relay.close, relay.reopen, a.store_outage)
            summary["replicas_exited"] = sum(p.poll() is not None for p, _ in procs)
            return summary
        finally:
            _stop(procs)
            relay.close()
    finally:
        moto.stop()


def run(a: argparse.Namespace) -> Report:
    if not (0 < a.requests <= 100):
        raise Usage(f"--requests must be 1..100 (the list read for completions holds 100), got {a.requests}")
    global LOGS
    LOGS = a.work / "faults-logs"
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
    wl = WORKLOADS[a.workload[0]]
    bund = bundle(a.work, wl, a.dtype[0], a.device)
    work = Path(tempfile.mkdtemp(prefix="wan-aot-faults-", dir=a.work))
    os.chmod(work, 0o755)
    runs: dict[str, Any] = {}
    try:
        if "postgres" in a.faults:
            runs[f"PostgreSQL stopped for {a.outage:g} s, 2 replicas (lease 5 s)"] = postgres_restart(a, bund, work)
            log("PostgreSQL restart done")
        if "disk" in a.faults:
            runs[f"the jobs directory's disk full for {a.outage:g} s"] = disk_full(a, bund, work)
            log("disk full done")
        if "store" in a.faults:
            runs[f"the S3 store unreachable for {a.store_outage:g} s"] = store_outage(a, bund, work, None)
            runs["the same, --store-retry-seconds 5"] = store_outage(a, bund, work, 5.0)
            log("store outage done")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    t = Table(f"{a.workload[0]}, {a.dtype[0]} ({wl.shape}): {a.requests} jobs of {a.steps} steps from {a.clients} "
              f"clients, the fault {a.fault_after:g} s in",
              ["fault", "completed", "failed (code)", "lost", "completed twice", "taken over",
               "fault's end → next job completed, s", "replicas exited"])
    for name, s in runs.items():
        if isinstance(s, str):
            t.add(name, s, "", "", "", "", "", "")
            continue
        codes = ", ".join(f"{n} {code}" for code, n in sorted(s["failed_by_code"].items())) or "0"
        t.add(name, f"{s['completed']} of {a.requests}", codes, s["lost"], s["duplicated"], s.get("taken_over", "-"),
              num(s["to_first_completed_s"]), s["replicas_exited"])
    t.notes.append("Clients retry a 503 (database_unavailable) after its Retry-After and a 507 after 1 s, as the "
                   "load measure does. Failed jobs are those the server failed on purpose (storage_full, "
                   "storage_unavailable): submitted again, they run.")
    bad = sum(s["lost"] + s["duplicated"] for s in runs.values() if not isinstance(s, str))
    return Report([t], runs, exit_code=1 if bad else 0)
