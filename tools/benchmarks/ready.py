"""Time to ready: `runtime serve` from process spawn to GET /ready answering 200 (bundle open and checked, every
weight placed, every program of every shape compiled), for a one-shape bundle and a four-shape one, against
`runtime generate`'s spawn to step 1 done; all with the same warm compilation cache, interleaved.

generate's first step includes encoding the prompt and one step of compute, which a server pays per job instead.
The four shapes are the workload's size and another one (its portrait, or for a square size a landscape one of
about as many pixels), each at the workload's frame count and a shorter one. Peak RSS is the server's VmHWM when
ready. Also reported: the seconds the four-shape server spends deserializing and compiling (from the cache) the
three extra shapes' own programs, which overlaps the weight load. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .common import (
    ROOT,
    WORKLOADS,
    Report,
    Table,
    Workload,
    add_common,
    bundle,
    child_env,
    log,
    median,
    num,
    peak_rss_gb,
    ratio,
    spawn,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, workloads=("tiny", "1.3b"), dtypes=("fp32",))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_ready(bund: Path, cache_dir: str, device: str = "cpu", timeout: float = 3600) -> tuple[float, float]:
    """(seconds from spawning `runtime serve` to GET /ready answering 200, the server's peak RSS in GB then)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="wan-aot-ready-jobs-") as jobs:
        spawned = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bund), "--port", str(port),
                                 "--jobs-dir", jobs, "--cache-dir", cache_dir, "-q"], cwd=ROOT, env=child_env(device),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            while time.time() - spawned < timeout:
                if proc.poll() is not None:
                    raise SystemExit(f"error: the server exited:\n{proc.stderr.read()[-3000:]}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
                        if r.status == 200:
                            return time.time() - spawned, peak_rss_gb(proc.pid)
                except OSError:
                    pass
                time.sleep(0.02)
            raise SystemExit(f"error: not ready after {timeout} s")
        finally:
            proc.kill()
            proc.wait()


SHAPE_COMPILES = """
import json, sys
import runtime
from runtime import cache

cache.enable(sys.argv[2])
pipe = runtime.load(sys.argv[1])
pipe.prepare(magcache=False)  # what `runtime serve` does before it is ready
per = {}
for key, seconds in pipe.bundle.timings.items():
    if key.startswith(("compile ", "deserialize ")):
        name = key.split(" ", 1)[1].split(":")[0]
        shape = name.split("@", 1)[1] if "@" in name else "default"
        per[shape] = per.get(shape, 0.0) + seconds
print(json.dumps(per))
"""


def extra_shapes_compile(bund: Path, cache_dir: str, device: str) -> float:
    """Seconds spent deserializing and compiling (from the warm cache) the non-default shapes' own programs while a
    server's `prepare` runs."""
    proc = subprocess.run([sys.executable, "-c", SHAPE_COMPILES, str(bund), cache_dir], cwd=ROOT, check=True,
                          env=child_env(device), capture_output=True, text=True)
    return sum(t for k, t in json.loads(proc.stdout.strip().splitlines()[-1]).items() if k != "default")


def four_shapes(wl: Workload) -> tuple[str, str]:
    w, h = wl.width, wl.height
    other = (h, w) if w != h else (w * 5 // 4 // 16 * 16, h * 3 // 4 // 16 * 16)
    short = max(1, (wl.frames - 1) // 2 // 4 * 4 + 1)
    return f"{w}x{h},{other[0]}x{other[1]}", f"{wl.frames},{short}"


def measure(a: argparse.Namespace, workload: str, dtype: str) -> tuple[list[str], dict[str, Any]]:
    wl = WORKLOADS[workload]
    target = a.device
    shapes = four_shapes(wl)
    one, four = bundle(a.work, wl, dtype, target), bundle(a.work, wl, dtype, target, shapes=shapes)
    runs: dict[str, list[tuple[float, float]]] = {"generate, 1 shape": [], "serve, 1 shape": [],
                                                  "serve, 4 shapes": []}
    own: list[float] = []
    with tempfile.TemporaryDirectory(prefix="wan-aot-ready-cache-") as cache:
        spawn("startup:child", {"bundle": str(one), "cache_dir": cache}, device=a.device)  # fill the cache
        for b in (one, four):
            serve_until_ready(b, cache, a.device)
        for i in range(a.repeats):  # interleaved
            first = spawn("startup:child", {"bundle": str(one), "cache_dir": cache}, device=a.device)
            runs["generate, 1 shape"].append((first["first_step"], float("nan")))
            runs["serve, 1 shape"].append(serve_until_ready(one, cache, a.device))
            runs["serve, 4 shapes"].append(serve_until_ready(four, cache, a.device))
            own.append(extra_shapes_compile(four, cache, a.device))
            log(f"{workload} {dtype} repeat {i + 1}/{a.repeats} done")
    med = {k: (median([t for t, _ in v]), median([m for _, m in v])) for k, v in runs.items()}
    base, one_s, four_s = med["generate, 1 shape"][0], med["serve, 1 shape"], med["serve, 4 shapes"]
    row = [f"{workload}, {dtype}", f"{shapes[0].replace(',', ', ')} x {shapes[1].replace(',', ', ')}", num(base),
           f"{num(one_s[0])} ({ratio(one_s[0], base)})", f"{num(four_s[0])} ({ratio(four_s[0], base)})",
           f"+{four_s[0] - one_s[0]:.2f}", num(median(own)), num(one_s[1]), num(four_s[1])]
    return row, {"workload": workload, "dtype": dtype, "runs": runs, "extra_shapes_compile": own}


def run(a: argparse.Namespace) -> Report:
    t = Table(f"spawn to ready, warm compilation cache ({a.device}; medians of {a.repeats} starts; seconds)",
              ["workload", "the 4 shapes", "generate: step 1 done", "serve, 1 shape: /ready 200 (vs generate)",
               "serve, 4 shapes", "4 - 1", "3 extra shapes' own compile", "peak RSS GB, 1 shape", "4 shapes"])
    raw = []
    for workload in a.workload:
        for dtype in a.dtype:
            row, r = measure(a, workload, dtype)
            t.add(*row)
            raw.append(r)
    t.notes.append("The 1-shape bundle has the first shape. Own compile: what the 4-shape server spends deserializing "
                   "and compiling (from the cache) the 3 extra shapes' programs, overlapping its weight load.")
    return Report([t], raw)
