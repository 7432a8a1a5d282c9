"""What a bundle's extra shapes cost: export time for 1, 2 and 4 shapes, and a server's time to ready and peak
RSS for 1 and 4 shapes (warm compilation cache), side by side in one run.

    python tools/bench_shapes.py export [--repeats 3]                 # tiny checkpoint, and 14B from names on tpu-v6e-8
    python tools/bench_shapes.py ready --workload tiny [--repeats 3]  # `runtime serve` 1 vs 4 shapes
    python tools/bench_shapes.py ready --workload 1.3b --dtype bf16   # the 1.3B-width workload of tools/bench.py

Shapes: the workload's size, then its portrait (height x width), then each of those at a shorter frame count
(1 shape: the first; 2: both sizes; 4: both sizes x both counts). Export time is process spawn to exit of
`python -m export`; "per extra shape" is (T(n) - T(1)) / (n - 1), against T(1), which also pays for loading
the model, tracing the shape-free stages and writing the weights. Time to ready is process spawn to GET /ready
answering 200 (every program of every shape compiled, every weight placed), after one unmeasured start that
fills the compilation cache; peak RSS is the server's VmHWM at that moment. Loopback only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

# name: (model, width, height, frames, shorter frames, extra export flags)
EXPORTS = {
    "tiny": ("tiny", 256, 144, 17, 9, ["--dtype", "fp32"]),
    "14b-tpu-v6e-8": ("wan2.1-t2v-14b", 1280, 720, 81, 49, ["--no-weights", "--target", "tpu-v6e-8"]),
}


def shape_flags(width: int, height: int, frames: int, shorter: int, n: int) -> list[str]:
    sizes = [f"{width}x{height}", f"{height}x{width}"][: 1 if n == 1 else 2]
    counts = [frames, shorter][: 2 if n == 4 else 1]
    return ["--resolution", ",".join(sizes), "--frames", ",".join(map(str, counts))]


def timed_export(model: str, flags: list[str], out: Path) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "export", "--model", model, *flags, "--out", str(out), "--force", "-q"],
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}, check=True)
    return time.perf_counter() - t


def bench_export(repeats: int, work: Path) -> None:
    print("| workload | shapes | export (s) | per extra shape (s) | extra shape / first |")
    print("| --- | --- | --- | --- | --- |")
    for name, (model, w, h, f, short, extra) in EXPORTS.items():
        times: dict[int, list[float]] = {1: [], 2: [], 4: []}
        for _ in range(repeats):  # interleaved, so drift hits every count alike
            for n in times:
                times[n].append(timed_export(model, [*shape_flags(w, h, f, short, n), *extra], work / f"{name}-{n}"))
        one = statistics.median(times[1])
        for n, ts in times.items():
            t = statistics.median(ts)
            extra_shape = "" if n == 1 else f"{(t - one) / (n - 1):.2f}"
            ratio = "" if n == 1 else f"{(t - one) / (n - 1) / one:.2f}x"
            print(f"| {name} | {n} | {t:.2f} | {extra_shape} | {ratio} |", flush=True)


def ready(bundle: Path, cache_dir: str) -> tuple[float, float]:
    """(seconds from spawn to /ready 200, the server's peak RSS in GB then): tools/bench_serve.py's measure."""
    from bench_serve import serve_until_ready

    return serve_until_ready(str(bundle), cache_dir, timeout=3600)


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


def shape_compiles(bundle: Path, cache_dir: str) -> dict[str, float]:
    """Seconds spent deserializing and compiling (from the warm cache) each shape's own programs while a server's
    `prepare` runs, by shape suffix ("default": the default shape's and the shape-free ones)."""
    import json

    proc = subprocess.run([sys.executable, "-c", SHAPE_COMPILES, str(bundle), cache_dir], cwd=ROOT, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_ready(workload: str, dtype: str, repeats: int, work: Path) -> None:
    from bench import WORKLOADS, prepare

    ckpt, _ = prepare(work, workload, dtype, "cpu")  # the workload's checkpoint (tools/bench.py)
    _, w, h, f, max_len = WORKLOADS[workload]
    if w == h:  # a landscape size of about as many pixels, so that its portrait is another shape
        w, h = w * 5 // 4 // 16 * 16, h * 3 // 4 // 16 * 16
    short = max(1, (f - 1) // 2 // 4 * 4 + 1)
    bundles = {}
    for n in (1, 4):
        bundles[n] = work / workload / f"shapes-{n}-{dtype}"
        if not (bundles[n] / "manifest.json").is_file():
            print(f"[bench] exporting {bundles[n]}", flush=True)
            timed_export(str(ckpt), [*shape_flags(w, h, f, short, n), "--dtype", dtype, "--max-sequence-length",
                                     str(max_len)], bundles[n])
    with tempfile.TemporaryDirectory(prefix="bench-shapes-cache-") as cache:
        for n in bundles:  # fill the cache (a warm start is what a restarted server sees)
            ready(bundles[n], cache)
        runs: dict[int, list[tuple[float, float]]] = {1: [], 4: []}
        own: list[float] = []
        for _ in range(repeats):
            for n in runs:
                runs[n].append(ready(bundles[n], cache))
            own.append(sum(t for k, t in shape_compiles(bundles[4], cache).items() if k != "default"))
    print(f"\n{workload} ({dtype}), shapes {w}x{h} and {h}x{w} x {f} and {short} frames; medians of {repeats}")
    print("| shapes | time to ready (s) | peak RSS (GB) |")
    print("| --- | --- | --- |")
    med = {n: (statistics.median(t for t, _ in r), statistics.median(m for _, m in r)) for n, r in runs.items()}
    for n, (t, m) in med.items():
        print(f"| {n} | {t:.2f} | {m:.2f} |")
    print(f"| 4 / 1 | {med[4][0] / med[1][0]:.2f}x | {med[4][1] / med[1][1]:.2f}x |")
    print(f"\ntime to ready, 4 shapes minus 1: {med[4][0] - med[1][0]:.2f} s; the 3 extra shapes' own programs "
          f"deserialized and compiled (from the cache) in the 4-shape server's prepare: {statistics.median(own):.2f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export time for 1, 2 and 4 shapes")
    r = sub.add_parser("ready", help="a server's time to ready and peak RSS, 1 vs 4 shapes")
    r.add_argument("--workload", choices=("tiny", "1.3b"), default="tiny")
    r.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    for q in (e, r):
        q.add_argument("--repeats", type=int, default=3)
        q.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"[bench] {cpu}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}", flush=True)
    if args.command == "export":
        bench_export(args.repeats, args.work / "shapes-export")
    else:
        bench_ready(args.workload, args.dtype, args.repeats, args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
