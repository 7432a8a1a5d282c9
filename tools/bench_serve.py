"""Time-to-ready of `runtime serve` against `runtime generate`'s time to its first denoising step, both
from process spawn with the same warm compilation cache, interleaved in one run.

    python tools/bench_serve.py artifacts/tiny [--repeats 3]
    python tools/bench_serve.py --workload 1.3b [--repeats 3]   # the 1.3B-shape bundle of tools/bench.py

Ready means GET /ready answered 200: the bundle is open and checked, every weight placed and every
program compiled (so the first job starts at once). generate's first step includes encoding the
prompt and one step of compute, which serving pays per job instead. Loopback only.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_ready(bundle: str, cache_dir: str, timeout: float = 1800) -> float:
    return serve_until_ready(bundle, cache_dir, timeout)[0]


def _peak_rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def serve_until_ready(bundle: str, cache_dir: str, timeout: float = 1800) -> tuple[float, float]:
    """(seconds from spawning `runtime serve` to GET /ready answering 200, the server's peak RSS in GB then)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="bench-serve-jobs-") as jobs:
        spawned = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", bundle, "--port", str(port),
                                 "--jobs-dir", jobs, "--cache-dir", cache_dir, "-q"], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            while time.time() - spawned < timeout:
                if proc.poll() is not None:
                    raise SystemExit(f"error: the server exited:\n{proc.stderr.read()[-3000:]}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
                        if r.status == 200:
                            return time.time() - spawned, _peak_rss_gb(proc.pid)
                except OSError:
                    pass
                time.sleep(0.02)
            raise SystemExit(f"error: not ready after {timeout} s")
        finally:
            proc.kill()
            proc.wait()


def main() -> int:
    from bench_startup import start

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", nargs="?")
    p.add_argument("--workload", choices=("1.3b",), help="build (once) and use tools/bench.py's bundle")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    bundle = args.bundle
    if args.workload:
        from bench import prepare

        bundle = str(prepare(ROOT / "artifacts" / "bench", args.workload, args.dtype, "cpu")[1])
    if not bundle:
        p.error("give a BUNDLE or --workload")
    ready, first = [], []
    with tempfile.TemporaryDirectory(prefix="bench-serve-cache-") as cache:
        start(bundle, cache)  # fills the compilation cache (and the OS page cache) for both
        time_to_ready(bundle, cache)
        for _ in range(args.repeats):
            ready.append(time_to_ready(bundle, cache))
            first.append(start(bundle, cache)["first_step"])
    r, f = statistics.median(ready), statistics.median(first)
    print(f"bundle {bundle}, warm compilation cache, {args.repeats} starts each, medians (s since spawn)")
    print(f"serve: spawn to /ready 200          {r:8.2f}   ({', '.join(f'{x:.2f}' for x in ready)})")
    print(f"generate: spawn to step 1 done      {f:8.2f}   ({', '.join(f'{x:.2f}' for x in first)})")
    print(f"ratio serve / generate = {r / f:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
