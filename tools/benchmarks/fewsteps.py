"""Few steps: what a step-distilled recipe saves, and how the samplers compare at equal steps, on one bundle.

1. Time to a video, encode -> denoise -> decode in one process with every program compiled first: 50 UniPC steps
   with classifier-free guidance (Wan's default) against 4 Euler steps at guidance 1 (what step- and CFG-distilled
   Wan runs: lightx2v's models and LoRAs), same shape, same bundle; interleaved over --repeats (default one run).
2. The samplers at equal steps: euler and dpm++ against unipc at each of --sampler-steps, by tools/quality.py's
   measures (frames PSNR, max error, first-step velocity error) from the same initial latents.

3. With --anyflow-steps (default 1 2 4 8; none to skip) on the 1.3b workload: AnyFlow's time to a video at each step
   count (flowmap sampler, guidance 1: one DiT pass per step) from the anyflow-1.3b workload's bundle, the same
   widths, shape and dtype, beside the base model's 50 UniPC steps, interleaved with them.

Random weights: the 4-step run is not a good video here (no distilled weights exist for this random model), it
costs what a distilled model's run costs; and the sampler comparison says how far apart the samplers' trajectories
are on this model, not which makes the better video.
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

RECIPES = {  # name: (steps, guidance, sampler, DiT passes per video)
    "50 unipc steps, guidance 5": (50, GUIDANCE, "unipc", 100),
    "4 euler steps, guidance 1": (4, 1.0, "euler", 4),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=1, workloads=("1.3b",), dtypes=("bf16",))
    p.add_argument("--sampler-steps", type=int, nargs="*", default=[10, 30],
                   help="step counts at which euler and dpm++ are compared with unipc (none: skip)")
    p.add_argument("--anyflow-steps", type=int, nargs="*", default=[1, 2, 4, 8],
                   help="AnyFlow's step counts timed beside the recipes (1.3b workload only; none: skip)")


def _video(pipe: Any, steps: int, guidance: float, sampler: str) -> dict[str, float]:
    t0 = time.perf_counter()
    embeds = pipe.encode(PROMPT, NEGATIVE)
    t1 = time.perf_counter()
    latents = pipe.denoise(embeds, seed=0, steps=steps, guidance=guidance, sampler=sampler, progress=False)
    t2 = time.perf_counter()
    pipe.decode(latents)
    t3 = time.perf_counter()
    return {"encode": t1 - t0, "denoise": t2 - t1, "decode": t3 - t2, "total": t3 - t0}


def measure(a: argparse.Namespace, workload: str, dtype: str) -> tuple[list[Table], dict[str, Any]]:
    from quality import compare  # tools/quality.py

    import runtime

    pipe = runtime.load(bundle(a.work, WORKLOADS[workload], dtype, a.device))
    pipe.prepare(magcache=False)
    name = f"{workload}, {dtype} ({WORKLOADS[workload].shape}; {a.device}"
    recipes = {k: (pipe, *r) for k, r in RECIPES.items()}
    if a.anyflow_steps and workload == "1.3b":
        anyflow = runtime.load(bundle(a.work, WORKLOADS["anyflow-1.3b"], dtype, a.device))
        anyflow.prepare(magcache=False)
        recipes.update({f"AnyFlow, {n} flowmap step{'s' * (n > 1)}, guidance 1": (anyflow, n, 1.0, "flowmap", n)
                        for n in a.anyflow_steps})
    times: dict[str, list[dict[str, float]]] = {k: [] for k in recipes}
    for i in range(a.repeats):  # interleaved
        for key, (model, steps, guidance, sampler, _) in recipes.items():
            times[key].append(_video(model, steps, guidance, sampler))
        log(f"{workload} {dtype} repeat {i + 1}/{a.repeats} done")
    video = Table(f"time to a video: {name}; median of {a.repeats}, programs compiled first)",
                  ["recipe", "DiT passes", "encode s", "denoise s", "decode s", "video s", "vs 50 steps"])
    base = median([t["total"] for t in times[next(iter(RECIPES))]])
    for key, (_, _, _, _, passes) in recipes.items():
        m = {part: median([t[part] for t in times[key]]) for part in ("encode", "denoise", "decode", "total")}
        video.add(key, passes, num(m["encode"], 2), num(m["denoise"], 2), num(m["decode"], 2), num(m["total"], 2),
                  ratio(m["total"], base))
    video.notes.append("Each bundle's flow shift; the encode and the decode are the same work for every row.")
    if len(recipes) > len(RECIPES):
        video.notes.append("AnyFlow: the anyflow-1.3b workload's bundle (AnyFlowTransformer3DModel at the same widths, "
                           "random weights), one bundle for every step count.")

    fidelity = Table(f"samplers at equal steps against unipc: {name}; guidance {GUIDANCE:g}, the bundle's flow shift)",
                     ["steps", "sampler", "frames PSNR dB", "max error (of 255)", "first-step velocity rel. error"])
    raw_fidelity = []
    for steps in a.sampler_steps:
        for sampler in ("euler", "dpm++"):
            (r,) = compare(pipe, pipe, [PROMPT], [0], steps, GUIDANCE, reference_sampler="unipc",
                           candidate_sampler=sampler)
            fidelity.add(steps, sampler, num(r.psnr_db, 1), num(r.max_error_levels, 1), f"{r.velocity_rel_error:.2e}")
            raw_fidelity.append({"steps": steps, "guidance": GUIDANCE, "sampler": sampler, "psnr_db": r.psnr_db,
                                 "max_error_levels": r.max_error_levels, "velocity_rel_error": r.velocity_rel_error})
            log(f"{workload} {dtype} {sampler} at {steps} steps compared")
    fidelity.notes.append("One prompt, seed 0, the same initial latents; unipc is the reference.")
    return [video, *([fidelity] if a.sampler_steps else [])], {"workload": workload, "dtype": dtype, "times": times, "fidelity": raw_fidelity}


def run(a: argparse.Namespace) -> Report:
    return each_workload(a, measure)
