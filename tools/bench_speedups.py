"""Issue 13's speed-ups, measured side by side in one process on one bundle.

    python tools/bench_speedups.py                          # 1.3B shapes (random weights), fp32, 10 steps
    python tools/bench_speedups.py --workload tiny --steps 20 --thresholds 0.03 0.06 0.12

1. CFG-free steps: the median denoising step at guidance 5 (the CFG program, batch 2) against guidance 1
   (the cond-only program, batch 1), and the latents of guidance 1 through both programs (equal).
2. MagCache: ratios calibrated on this bundle (`Pipeline.calibrate`, as diffusers' calibration mode),
   then the whole denoising loop with MagCache at each threshold against the uncached loop: wall time,
   speed-up, steps skipped, and the decoded frames' max / mean abs difference from the uncached video.

The bundle comes from tools/bench.py's workloads (the 1.3b one is the real Wan2.1-1.3B DiT and VAE
with random weights at 128x128, 9 frames), built once under --work. Random weights make the
calibrated ratios (and so the schedule) those of this bundle, not of the released model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

PROMPT = "a cat playing piano in a jazz club"
NEGATIVE = "blurry, low quality"


def timed_denoise(pipe, embeds, **kw) -> tuple[object, float, list[float]]:
    marks = [time.perf_counter()]
    t0 = marks[0]
    latents = pipe.denoise(embeds, progress=False, on_step=lambda i: marks.append(time.perf_counter()), **kw)
    return latents, time.perf_counter() - t0, [b - a for a, b in zip(marks, marks[1:])]


def main() -> int:
    import bench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="1.3b", choices=list(bench.WORKLOADS))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.02, 0.06, 0.12, 0.24])
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench")
    a = p.parse_args()

    import numpy as np

    import runtime
    from runtime.magcache import MagCache

    _, bundle = bench.prepare(a.work, a.workload, a.dtype, "cpu")
    pipe = runtime.load(bundle)
    t = time.perf_counter()
    pipe.prepare()  # every program compiled: the timings below are steady state
    print(f"[bench] {bundle}: compiled {len(pipe.manifest.programs)} programs in {time.perf_counter() - t:.0f} s")
    embeds = pipe.encode(PROMPT, NEGATIVE)
    steady = lambda times: statistics.median(times[1:])  # noqa: E731  (step 1 pays the first placements)

    print(f"\n## CFG-free steps ({a.workload}, {a.dtype}, {a.steps} steps)\n")
    _, _, cfg_steps = timed_denoise(pipe, embeds, seed=0, steps=a.steps, guidance=5.0)
    g1, _, cond_steps = timed_denoise(pipe, embeds, seed=0, steps=a.steps, guidance=1.0)
    plan = pipe.step_programs
    pipe.step_programs = lambda *args, **kw: ["denoise_step"] * a.steps
    g1_cfg, _, _ = timed_denoise(pipe, embeds, seed=0, steps=a.steps, guidance=1.0)
    pipe.step_programs = plan
    print("| guidance | program | median step (s) | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| 5 | denoise_step (batch 2) | {steady(cfg_steps):.3f} | 1.00 |")
    print(f"| 1 | denoise_step_cond (batch 1) | {steady(cond_steps):.3f} | {steady(cond_steps) / steady(cfg_steps):.2f} |")
    print(f"\nguidance 1, cond-only vs CFG program latents: max abs diff {np.abs(g1 - g1_cfg).max():.2e}")

    print(f"\n## MagCache ({a.workload}, {a.dtype}, {a.steps} steps, guidance 5)\n")
    ratios = pipe.calibrate(embeds, seed=0, steps=a.steps, guidance=5.0, progress=False)
    print("calibrated ratios: " + ", ".join(f"{r:.4f}" for r in ratios))
    base, base_s, _ = timed_denoise(pipe, embeds, seed=0, steps=a.steps, guidance=5.0)
    base_frames = pipe.decode(base)
    print("\n| threshold | steps skipped | denoise (s) | speed-up | frames max abs diff | frames mean abs diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| off | 0 | {base_s:.1f} | 1.00 | 0 | 0 |")
    for th in a.thresholds:
        cache = MagCache(ratios, threshold=th)
        skipped = cache.schedule([0] * a.steps).count(False)
        lat, secs, _ = timed_denoise(pipe, embeds, seed=0, steps=a.steps, guidance=5.0, magcache=cache)
        diff = np.abs(pipe.decode(lat) - base_frames)
        print(f"| {th:g} | {skipped} | {secs:.1f} | {base_s / secs:.2f} | {diff.max():.4f} | {diff.mean():.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
