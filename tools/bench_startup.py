"""Start-up time of the runtime: process start to the first denoising step done, on a machine's
first start (empty compilation cache, no verified stamp) and on every later one (both warm), side
by side in one run, with a breakdown of where the seconds go.

    python tools/bench_startup.py artifacts/tiny [--repeats 5]

Each start is a fresh `python` process doing what `runtime generate` does up to its first step:
import the runtime, open the bundle (manifest, programs and tokenizer checked), start loading every
stage in the background, tokenize and encode the prompt, run denoising step 1. "first" gives every
start a new cache and stamp directory; "warm" reuses ones that a previous start filled. Prints the
median of each phase (seconds since the process was spawned), the ratio of the totals, and the
work behind them: per weight group the mapping (+ sha256 when not stamped) and placement, per program
deserialization and compilation (background work overlaps the foreground phases).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("imported", "loaded", "encoded", "first_step")


class _Stop(Exception):
    pass


def child(bundle: str, cache_dir: str, spawned: float) -> dict[str, float]:
    """One start, in this (fresh) process; times are seconds since the parent spawned it."""
    marks = {}
    os.environ["WAN_AOT_STAMP_DIR"] = str(Path(cache_dir) / "stamps")
    import runtime

    marks["imported"] = time.time() - spawned
    runtime.enable_compilation_cache(cache_dir)
    pipe = runtime.load(bundle)
    marks["loaded"] = time.time() - spawned
    prompt = "a cat playing piano in a jazz club"
    pipe.start_loading(prompt=prompt)  # as generate: the stages before step 1 load in the background
    embeds = pipe.encode(prompt)
    marks["encoded"] = time.time() - spawned

    def first(i: int) -> None:
        marks["first_step"] = time.time() - spawned
        raise _Stop

    try:
        pipe.denoise(embeds, seed=0, progress=False, on_step=first)
    except _Stop:
        pass
    pipe.bundle.cancel_prefetch()
    return {**marks, **{f"work: {k}": v for k, v in pipe.bundle.timings.items()}}


def start(bundle: str, cache_dir: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    spawned = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", bundle, cache_dir, repr(spawned)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: the child process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], float(sys.argv[4]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    runs: dict[str, list[dict[str, float]]] = {"empty": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        warm_dir = str(Path(tmp) / "warm")
        start(args.bundle, warm_dir)  # fill the warm cache (and the OS page cache, for both)
        for i in range(args.repeats):  # interleaved, so drift affects both alike
            runs["empty"].append(start(args.bundle, str(Path(tmp) / f"empty-{i}")))
            runs["warm"].append(start(args.bundle, warm_dir))

    med = {k: {ph: statistics.median(r[ph] for r in v) for ph in PHASES} for k, v in runs.items()}
    print(f"bundle {args.bundle}, {args.repeats} starts each, medians (s since process spawn)")
    print(f"{'start':<7}" + "".join(f"{ph:>12}" for ph in PHASES))
    for k in ("empty", "warm"):
        print(f"{'first' if k == 'empty' else k:<7}" + "".join(f"{med[k][ph]:>12.2f}" for ph in PHASES))
    ratio = med["warm"]["first_step"] / med["empty"]["first_step"]
    print(f"warm start / first start = {ratio:.2f} ({med['empty']['first_step']:.2f} s -> "
          f"{med['warm']['first_step']:.2f} s)")
    work = sorted({k for v in runs.values() for r in v for k in r if k.startswith("work: ")})
    print(f"\n{'work behind the phases (s, median)':<48}{'first':>10}{'warm':>10}")
    for k in work:
        cells = [statistics.median(r.get(k, 0.0) for r in runs[c]) for c in ("empty", "warm")]
        print(f"{k[6:]:<48}" + "".join(f"{c:>10.2f}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
