"""What VACE's branch costs a denoising step: the steady step of Wan2.1-T2V-1.3B's widths against Wan2.1-VACE-1.3B's
(the same 30 blocks and 15 VACE blocks that run before them, on the embedded input, and hand their hints to the
blocks), at the same shape, with guidance (the CFG program, batch 2) and without (the cond-only program).

Every program is compiled first (`Pipeline.prepare`), and step 1 of each loop is left out; loops are interleaved over
--repeats. The VACE run has a control video (its latents are the step's `control` input; what it holds does not
change the step's cost).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from .common import GUIDANCE, NEGATIVE, PROMPT, WORKLOADS, Report, Table, add_common, bundle, log, median, num, ratio


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=3, dtypes=("bf16",))
    p.add_argument("--steps", type=int, default=6)


def _steps(pipe: Any, embeds: Any, steps: int, guidance: float) -> list[float]:
    marks = [time.perf_counter()]
    pipe.denoise(embeds, seed=0, steps=steps, guidance=guidance, progress=False,
                 on_step=lambda i: marks.append(time.perf_counter()))
    return [b - a for a, b in zip(marks[1:], marks[2:])]  # step 1 left out


def run(a: argparse.Namespace) -> Report:
    import numpy as np

    import runtime

    times: dict[tuple[str, str, float], list[float]] = {}
    tables = []
    for dtype in a.dtype:
        pipes, embeds = {}, {}
        for name in ("1.3b", "vace-1.3b"):
            wl = WORKLOADS[name]
            pipes[name] = runtime.load(bundle(a.work, wl, dtype, a.device))
            pipes[name].prepare(magcache=False)
            video = None
            if pipes[name].kind.vace:
                video = list(np.random.default_rng(0).integers(0, 255, (wl.frames, wl.height, wl.width, 3), np.uint8))
            embeds[name] = pipes[name].encode(PROMPT, NEGATIVE, **({"video": np.stack(video)} if video else {}))
        for i in range(a.repeats):  # interleaved
            for name in pipes:
                for guidance in (GUIDANCE, 1.0):
                    times.setdefault((dtype, name, guidance), []).extend(_steps(pipes[name], embeds[name], a.steps,
                                                                                 guidance))
            log(f"{dtype} repeat {i + 1}/{a.repeats} done")
        wl = WORKLOADS["1.3b"]
        table = Table(f"a denoising step, T2V against VACE: 1.3B widths, {dtype} ({wl.shape}; {a.device}; median of "
                      f"{a.repeats} x {a.steps - 1} steps)", ["guidance", "t2v step s", "vace step s", "vace / t2v"])
        for guidance in (GUIDANCE, 1.0):
            t2v, vace = (median(times[dtype, n, guidance]) for n in ("1.3b", "vace-1.3b"))
            table.add(f"{guidance:g} ({'CFG, batch 2' if guidance > 1 else 'cond only, batch 1'})", num(t2v, 3),
                      num(vace, 3), ratio(vace, t2v))
        table.notes.append("Random weights of the real shapes; the VACE blocks are 15 more transformer blocks (and "
                           "their hint projections) over the same tokens: half of the DiT's 30 again.")
        tables.append(table)
    return Report(tables, {f"{d}/{n}/{g:g}": ts for (d, n, g), ts in times.items()})
