"""Start-up time of the runtime: process start to the first denoising step done, with an empty and
a warm persistent compilation cache, measured side by side in one run.

    python tools/bench_startup.py artifacts/tiny [--repeats 5]

Each start is a fresh `python` process (import jax and the runtime, open and sha256-check the
bundle, place the weights, tokenize and encode the prompt, run denoising step 1). "empty" gives
every start a new cache directory; "warm" reuses one that a previous start filled. Prints the
median of each phase (seconds since the process was spawned) and the ratio of the totals.
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
    import runtime

    marks["imported"] = time.time() - spawned
    runtime.enable_compilation_cache(cache_dir)
    pipe = runtime.load(bundle)
    marks["loaded"] = time.time() - spawned
    embeds = pipe.encode("a cat playing piano in a jazz club")
    marks["encoded"] = time.time() - spawned

    def first(i: int) -> None:
        marks["first_step"] = time.time() - spawned
        raise _Stop

    try:
        pipe.denoise(embeds, seed=0, progress=False, on_step=first)
    except _Stop:
        pass
    return marks


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
    print(f"{'cache':<7}" + "".join(f"{ph:>12}" for ph in PHASES))
    for k in ("empty", "warm"):
        print(f"{k:<7}" + "".join(f"{med[k][ph]:>12.2f}" for ph in PHASES))
    ratio = med["warm"]["first_step"] / med["empty"]["first_step"]
    print(f"second start (warm cache) / first start (empty cache) = {ratio:.2f} "
          f"({med['empty']['first_step']:.2f} s -> {med['warm']['first_step']:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
