"""Serving throughput and latency under load (benchmarks/load.py), in one run: one replica on its SQLite queue,
one and two replicas on one PostgreSQL queue, and two with one SIGKILLed part way.

Starts its own PostgreSQL server (Debian's, in a temporary directory, as the `postgres` user when run as root) on
a loopback port with a new database per run, and the replicas (`runtime serve`, PostgreSQL ones with `--queue ...
--lease 5`, sharing one jobs directory for the videos); waits until each is ready, then runs the load: --requests
jobs of --steps steps from --clients clients. Ratios of throughput are against the single SQLite replica. "Taken
over" counts jobs that ran a second attempt after their replica died. Everything listens on 127.0.0.1; every
process is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import load
from .common import (
    ROOT,
    WORKLOADS,
    Report,
    Table,
    Usage,
    add_common,
    bundle,
    child_env,
    log,
    median,
    num,
    ratio,
)

PG_BIN = Path("/usr/lib/postgresql/15/bin")
LEASE = "5"
CONFIGS = (("1 replica, SQLite", 1, False, False), ("1 replica, PostgreSQL", 1, True, False),
           ("2 replicas, PostgreSQL", 2, True, False), ("2 replicas, PostgreSQL, one SIGKILLed", 2, True, True))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=1, devices=("cpu",), workloads=("tiny",), dtypes=("fp32",))
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kill-after", type=float, default=8.0, help="seconds into the run the first replica is killed")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(*cmd: str) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


class Postgres:
    """A throwaway PostgreSQL server on a loopback port."""

    def __init__(self) -> None:
        if not (PG_BIN / "initdb").is_file():
            raise Usage(f"PostgreSQL 15 is not installed ({PG_BIN}): apt-get install postgresql")
        self.root = Path(tempfile.mkdtemp(prefix="wan-aot-bench-pg-"))
        self.root.chmod(0o755)
        (self.root / "sock").mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.root / "sock", "postgres")
        self.port = _port()
        subprocess.run(_as_postgres(str(PG_BIN / "initdb"), "-D", str(self.root / "data"), "-A", "trust", "-U",
                                    "postgres"), check=True, capture_output=True)
        subprocess.run(_as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-o",
                                    f"-p {self.port} -k {self.root / 'sock'} -c listen_addresses=127.0.0.1", "-l",
                                    str(self.root / "log"), "-w", "start"), check=True, capture_output=True)
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + "/" + name

    def stop(self) -> None:
        subprocess.run(_as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate",
                                    "stop"), capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def start_replica(bund: Path, queue: str | None, jobs: Path, logfile: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    flags = ["--queue", queue, "--lease", LEASE] if queue else []
    with open(logfile, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bund), "--port", str(port),
                                 "--jobs-dir", str(jobs), "--queue-size", "64", *flags], cwd=ROOT, env=child_env(),
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: a replica exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"error: {url} not ready in {timeout} s")


def one_run(a: argparse.Namespace, pg: Postgres, bund: Path, replicas: int, postgres: bool, kill: bool, work: Path,
            name: str) -> dict[str, Any]:
    queue = pg.database(name) if postgres else None
    jobs = work / name / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    procs = [start_replica(bund, queue, jobs, work / f"{name}-{i}.log") for i in range(replicas)]
    try:
        for proc, url in procs:
            wait_ready(url, proc)
        args = argparse.Namespace(urls=[u for _, u in procs], clients=a.clients, requests=a.requests, steps=a.steps,
                                  timeout=900.0, max_retries=30, poll_interval=None, api_key=None, repeats=1,
                                  prompt="a red fox running through fresh snow",
                                  kill_pid=procs[0][0].pid if kill else None, kill_after=a.kill_after if kill else None)
        summary = load.load(args, load.check(args))
        taken_over = 0
        if queue:
            import psycopg

            with psycopg.connect(queue) as conn:  # jobs run again after their replica died
                (taken_over,) = conn.execute("SELECT COUNT(*) FROM jobs WHERE attempts > 1").fetchone()
        return {**summary, "taken_over": taken_over}
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def run(a: argparse.Namespace) -> Report:
    wl = WORKLOADS[a.workload[0]]
    bund = bundle(a.work, wl, a.dtype[0], a.device)
    work = a.work / "serve"
    work.mkdir(parents=True, exist_ok=True)
    pg = Postgres()
    runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in CONFIGS}
    try:
        stamp = int(time.time())
        for i in range(a.repeats):  # interleaved
            for k, (name, replicas, postgres, kill) in enumerate(CONFIGS):
                runs[name].append(one_run(a, pg, bund, replicas, postgres, kill, work, f"r{k}_{i}_{stamp}"))
                log(f"repeat {i + 1}/{a.repeats}: {name} done")
    finally:
        pg.stop()
    base = median([s["throughput_jobs_per_s"] for s in runs[CONFIGS[0][0]]])
    t = Table(f"{a.workload[0]}, {a.dtype[0]} ({wl.shape}): {a.requests} jobs of {a.steps} steps from {a.clients} "
              f"clients (medians of {a.repeats} runs)",
              ["configuration", "throughput jobs/s", "vs 1 SQLite replica", "submit→completed p50 s", "p95 s",
               "max s", "lost / duplicated", "taken over"])
    for name, rs in runs.items():
        def lat(key: str, rs: list[dict[str, Any]] = rs) -> str:
            return num(median([r["latency_submit_to_completed_s"][key] or float("nan") for r in rs]))

        tput = median([r["throughput_jobs_per_s"] for r in rs])
        t.add(name + (f" at {a.kill_after:g} s" if "SIGKILL" in name else ""), num(tput), ratio(tput, base),
              lat("p50"), lat("p95"), lat("max"), f"{sum(r['lost'] for r in rs)} / {sum(r['duplicated'] for r in rs)}",
              sum(r["taken_over"] for r in rs))
    t.notes.append(f"Replicas share this machine's {os.cpu_count()} cores, so a second replica adds little compute "
                   f"here; on a slice each replica has its own chips. Lease {LEASE} s.")
    bad = sum(r["lost"] + r["duplicated"] for rs in runs.values() for r in rs)
    return Report([t], runs, exit_code=1 if bad else 0)
