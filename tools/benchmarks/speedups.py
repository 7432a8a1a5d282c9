"""The speed-ups a run can ask for, and what they cost in fidelity, side by side in one process on one bundle.

1. CFG-free steps: the steady denoising step at guidance 5 (the CFG program, batch 2) against guidance 1 (the
   cond-only program, batch 1), and the guidance-1 latents through both programs (equal within float error).
2. MagCache: ratios calibrated on this bundle (`Pipeline.calibrate`, as diffusers' calibration mode), then the
   whole denoising loop at each threshold against the uncached loop: wall time, speed-up, steps skipped, and the
   decoded frames' PSNR and max / mean abs difference from the uncached video.

Every program is compiled first, so the timings are steady state; loops are interleaved over --repeats. Random
weights make the calibrated ratios (and so the skip schedule) those of this bundle, not of a released model.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from .common import (
    GUIDANCE,
    NEGATIVE,
    PROMPT,
    WORKLOADS,
    Report,
    Table,
    add_common,
    bundle,
    each_workload,
    log,
    median,
    num,
    ratio,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=3, workloads=("1.3b",), dtypes=("bf16",))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.02, 0.06, 0.12, 0.24])


def _denoise(pipe: Any, embeds: Any, **kw: Any) -> tuple[Any, float, list[float]]:
    marks = [time.perf_counter()]
    latents = pipe.denoise(embeds, progress=False, on_step=lambda i: marks.append(time.perf_counter()), **kw)
    return latents, marks[-1] - marks[0], [b - a for a, b in zip(marks, marks[1:])]


def measure(a: argparse.Namespace, workload: str, dtype: str) -> tuple[list[Table], dict[str, Any]]:
    import numpy as np
    from quality import psnr  # tools/quality.py

    import runtime
    from runtime.magcache import MagCache

    pipe = runtime.load(bundle(a.work, WORKLOADS[workload], dtype, a.device))
    pipe.prepare()
    embeds = pipe.encode(PROMPT, NEGATIVE)
    name = f"{workload}, {dtype} ({WORKLOADS[workload].shape}; {a.device}; {a.steps} steps"

    steps: dict[str, list[float]] = {"cfg": [], "cond": []}
    for _ in range(a.repeats):
        steps["cfg"] += _denoise(pipe, embeds, seed=0, steps=a.steps, guidance=GUIDANCE)[2][1:]  # step 1 is cold
        g1, _, t = _denoise(pipe, embeds, seed=0, steps=a.steps, guidance=1.0)
        steps["cond"] += t[1:]
    plan = pipe.step_programs
    pipe.step_programs = lambda *args, **kw: ["denoise_step"] * a.steps
    g1_cfg = _denoise(pipe, embeds, seed=0, steps=a.steps, guidance=1.0)[0]
    pipe.step_programs = plan
    cfg = Table(f"CFG-free steps: {name}; median step of {a.repeats} loops)",
                ["guidance", "program", "step s", "vs guidance 5"])
    cfg.add(f"{GUIDANCE:g}", "denoise_step (batch 2)", num(median(steps["cfg"]), 3), "1.00x")
    cfg.add("1", "denoise_step_cond (batch 1)", num(median(steps["cond"]), 3),
            ratio(median(steps["cond"]), median(steps["cfg"])))
    cfg.notes.append(f"Guidance 1 through the cond-only and the CFG program: latents within "
                     f"{float(np.abs(g1 - g1_cfg).max()):.1e}.")

    ratios = pipe.calibrate(embeds, seed=0, steps=a.steps, guidance=GUIDANCE, progress=False)
    times: dict[str, list[float]] = {"off": [], **{f"{th:g}": [] for th in a.thresholds}}
    frames: dict[str, Any] = {}
    for i in range(a.repeats):  # interleaved
        for th in [None, *a.thresholds]:
            key = "off" if th is None else f"{th:g}"
            cache = None if th is None else MagCache(ratios, threshold=th)
            lat, secs, _ = _denoise(pipe, embeds, seed=0, steps=a.steps, guidance=GUIDANCE, magcache=cache)
            times[key].append(secs)
            if i == 0:
                frames[key] = pipe.decode(lat)
        log(f"{workload} {dtype} MagCache repeat {i + 1}/{a.repeats} done")
    mag = Table(f"MagCache: {name}, guidance {GUIDANCE:g}; median loop of {a.repeats})",
                ["threshold", "steps skipped", "denoise s", "speed-up", "frames PSNR dB", "max abs diff",
                 "mean abs diff"])
    base = median(times["off"])
    for key, ts in times.items():
        skipped = 0 if key == "off" else MagCache(ratios, threshold=float(key)).schedule([0] * a.steps).count(False)
        diff = np.abs(frames[key] - frames["off"])
        mag.add(key, skipped, num(median(ts), 2), ratio(base, median(ts)),
                "-" if key == "off" else num(psnr(frames[key], frames["off"]), 1), num(float(diff.max()), 4),
                num(float(diff.mean()), 5))
    mag.notes.append("Frames in [0, 1], against the uncached run's; calibrated ratios: "
                     + ", ".join(f"{r:.3f}" for r in ratios) + ".")
    return [cfg, mag], {"workload": workload, "dtype": dtype, "steps": steps, "magcache": times,
                        "ratios": list(ratios)}


def run(a: argparse.Namespace) -> Report:
    return each_workload(a, measure)
