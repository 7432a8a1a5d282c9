"""Replicas on one PostgreSQL queue under load: 1 replica, 2 replicas, and 2 with one SIGKILLed part way,
measured with tools/load_test.py in one run.

    python tools/bench_replicas.py [--bundle artifacts/tiny] [--requests 24] [--clients 4] [--steps 4]

Starts its own PostgreSQL server (Debian's, in a temporary directory, as the `postgres` user when run as root)
on a loopback port, a new database per configuration, the replicas (`runtime serve --queue ... --lease 5`,
sharing one jobs directory for the videos), waits until each is ready, then runs
`tools/load_test.py --url ... [--url ...] [--kill-pid PID --kill-after S]` and prints its figures. Without
--bundle it exports the README's tiny bundle (256x144, 17 frames, bf16) under artifacts/bench/replicas/.
Everything listens on 127.0.0.1; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
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

ROOT = Path(__file__).resolve().parents[1]
PG_BIN = Path("/usr/lib/postgresql/15/bin")
LEASE = "5"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(*cmd: str) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


class Postgres:
    def __init__(self) -> None:
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


def start_replica(bundle: Path, queue: str, jobs: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bundle), "--port", str(port), "--queue",
                             queue, "--jobs-dir", str(jobs), "--lease", LEASE, "--queue-size", "64"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=open(log, "w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)
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


def run(pg: Postgres, bundle: Path, n: int, kill_after: float | None, args: argparse.Namespace, work: Path,
        name: str) -> dict:
    queue = pg.database(name)
    procs = [start_replica(bundle, queue, work / name / "jobs", work / f"{name}-{i}.log") for i in range(n)]
    (work / name / "jobs").mkdir(parents=True, exist_ok=True)
    try:
        for proc, url in procs:
            wait_ready(url, proc)
        cmd = [sys.executable, str(ROOT / "tools" / "load_test.py"), "--clients", str(args.clients), "--requests",
               str(args.requests), "--steps", str(args.steps), "--json", str(work / f"{name}.json"),
               "--timeout", "900"]
        for _, url in procs:
            cmd += ["--url", url]
        if kill_after is not None:
            cmd += ["--kill-pid", str(procs[0][0].pid), "--kill-after", str(kill_after)]
        subprocess.run(cmd, cwd=ROOT, check=False, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        import psycopg

        with psycopg.connect(queue) as conn:  # jobs run again after their replica died: taken over
            (again,) = conn.execute("SELECT COUNT(*) FROM jobs WHERE attempts > 1").fetchone()
        return {**json.loads((work / f"{name}.json").read_text()), "taken_over": again}
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=None)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kill-after", type=float, default=8.0, help="seconds into the run the first replica is killed")
    args = p.parse_args()
    work = ROOT / "artifacts" / "bench" / "replicas"
    work.mkdir(parents=True, exist_ok=True)
    bundle = args.bundle or work / "tiny"
    if not (bundle / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "export", "--model", "tiny", "--resolution", "256x144", "--frames",
                        "17", "--out", str(bundle), "--force", "-q"], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"[bench] {cpu}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; {args.requests} jobs of {args.steps} "
          f"steps, {args.clients} clients, lease {LEASE} s", flush=True)
    pg = Postgres()
    rows = []
    try:
        stamp = int(time.time())
        for n, kill in ((1, None), (2, None), (2, args.kill_after)):
            name = f"r{n}{'k' if kill else ''}_{stamp}"
            s = run(pg, bundle, n, kill, args, work, name)
            rows.append((n, kill, s))
            print(f"[bench] {n} replica(s){' one killed' if kill else ''}: done", flush=True)
    finally:
        pg.stop()
    print("| replicas | killed | accepted / 429 | completed / failed / lost / duplicated | throughput (jobs/s) "
          "| submit→completed p50 / p95 / max (s) | accepted by | taken over |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, kill, s in rows:
        lat = s["latency_submit_to_completed_s"]
        by = ", ".join(str(v) for _, v in sorted(s["accepted_by"].items()))
        print(f"| {n} | {f'replica 1 at {kill:g} s' if kill else 'no'} | {s['accepted']} / {s['rejected_429']} | "
              f"{s['completed']} / {s['failed']} / {s['lost']} / {s['duplicated']} | "
              f"{s['throughput_jobs_per_s']:.2f} | {lat['p50']:.2f} / {lat['p95']:.2f} / {lat['max']:.2f} | {by} | "
              f"{s['taken_over']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
