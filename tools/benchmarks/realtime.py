"""Real time: AnyFlow-FAR's chunks as a live session makes them (runtime/far.py `stream`), at 1, 2 and 4 flow-map
steps per chunk, on the far-1.3b workload (AnyFlow-FAR-1.3B's widths, random weights).

For each step count, a session from its start to its last chunk, every program compiled first: the time to the first
chunk's frames (the prompt encoded, the first chunk denoised and decoded), the time per later chunk (its cache write,
its steps, its decode), and the realtime factor: the seconds of video made per wall second (frames at the bundle's
fps over the session's seconds; 1.0 plays as fast as it is made). Interleaved over --repeats; medians.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from .common import PROMPT, WORKLOADS, Report, Table, add_common, bundle, each_workload, log, median, num


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=2, workloads=("far-1.3b",), dtypes=("bf16",))
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4], help="flow-map steps per chunk (default 1 2 4)")


def _session(pipe: Any, steps: int) -> dict[str, Any]:
    from runtime import far

    t0 = time.perf_counter()
    marks, frames = [], 0
    for chunk in far.stream(pipe, PROMPT, steps=steps, guidance=1.0, seed=0):
        frames += chunk.frames.shape[1] if chunk.frames is not None else 0
        marks.append(time.perf_counter() - t0)
    return {"first": marks[0], "per_chunk": [b - a for a, b in zip(marks, marks[1:])], "total": marks[-1],
            "frames": frames, "chunks": len(marks)}


def measure(a: argparse.Namespace, workload: str, dtype: str) -> tuple[list[Table], dict[str, Any]]:
    import runtime

    wl = WORKLOADS[workload]
    pipe = runtime.load(bundle(a.work, wl, dtype, a.device))
    pipe.prepare(magcache=False)
    fps = pipe.manifest.defaults.fps
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in a.steps}
    _session(pipe, a.steps[0])  # the noise sampler and the decoder's first call, once
    for i in range(a.repeats):  # interleaved
        for n in a.steps:
            runs[n].append(_session(pipe, n))
        log(f"{workload} {dtype} repeat {i + 1}/{a.repeats} done")
    table = Table(f"AnyFlow-FAR live session: {workload}, {dtype} ({wl.shape}; {a.device}; median of {a.repeats}, "
                  "programs compiled first)",
                  ["steps per chunk", "chunks", "frames", "first chunk s", "per later chunk s", "session s",
                   f"realtime factor ({fps} fps)"])
    for n, rs in runs.items():
        total = median([r["total"] for r in rs])
        table.add(n, rs[0]["chunks"], rs[0]["frames"], num(median([r["first"] for r in rs]), 2),
                  num(median([x for r in rs for x in r["per_chunk"]]), 2), num(total, 2),
                  num(rs[0]["frames"] / fps / total, 3))
    table.notes.append("Guidance 1 (one DiT pass per step); a later chunk's time includes the KV cache write of the "
                       "chunks before it under the prompt in force, and its VAE decode.")
    return [table], {"workload": workload, "dtype": dtype, "fps": fps, "runs": runs}


def run(a: argparse.Namespace) -> Report:
    return each_workload(a, measure)
