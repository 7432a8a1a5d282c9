"""What a live preview costs a denoising step (the server's `content?variant=thumbnail` while a job runs).

In one process, every program compiled first, the prompt encoded once: denoising runs of --steps steps without a
preview and with one (runtime/previews.py: the scheduler's denoised estimate of the middle frame through the latent
family's 3 x C map, on the device, copied to the host, handed to the server's PreviewWriter, which stores it as a PNG
under a temporary jobs directory, the first at once and the rest from its own thread), interleaved over --repeats;
the step time of each (the run's time over its steps), and the difference as a share of a step. Beside it, the
preview's own work timed alone: the device projection and copy (per call, the median of 50), and the PNG a store
writes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import NEGATIVE, PROMPT, WORKLOADS, Report, Table, add_common, bundle, log, median, num


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=5, devices=("cpu",), workloads=("1.3b", "tiny"), dtypes=("fp32",))
    p.add_argument("--steps", type=int, default=8, help="denoising steps per run (default 8)")


def measure(a: argparse.Namespace, workload: str, dtype: str) -> tuple[Table, dict[str, Any]]:
    import runtime
    from runtime import previews
    from runtime.serve.storage import Directory
    from runtime.serve.thumbnails import PreviewWriter

    pipe = runtime.load(bundle(a.work, WORKLOADS[workload], dtype, a.device))
    pipe.prepare(magcache=False)
    g = pipe.geometry
    embeds = pipe.encode(PROMPT, NEGATIVE)
    pipe.denoise(embeds, seed=0, steps=2, progress=False, on_preview=lambda rgb: None)  # compile the projection
    in_loop: list[float] = []  # per step: the projection, its copy to the host and the hand-over to the writer
    project = previews.Previewer.__call__

    def timed(self: Any, state: Any) -> Any:
        t = time.perf_counter()
        out = project(self, state)
        in_loop.append(time.perf_counter() - t)
        return out

    times: dict[str, list[float]] = {"without": [], "with": []}
    handover: list[float] = []
    with tempfile.TemporaryDirectory(prefix="wan-aot-bench-preview-") as d:
        storage = Directory(Path(d))
        for i in range(a.repeats):  # interleaved
            for key in times:
                writer = PreviewWriter(storage, f"previews/bench-{i}.png") if key == "with" else None

                def offer(rgb: Any, writer: Any = writer) -> None:
                    t = time.perf_counter()
                    writer.offer(rgb)
                    handover.append(time.perf_counter() - t)

                previews.Previewer.__call__ = timed  # type: ignore[method-assign]
                try:
                    t = time.perf_counter()
                    pipe.denoise(embeds, seed=0, steps=a.steps, progress=False, on_preview=offer if writer else None)
                    times[key].append((time.perf_counter() - t) / a.steps)
                finally:
                    previews.Previewer.__call__ = project  # type: ignore[method-assign]
                if writer:
                    writer.close()
            log(f"{workload} {dtype} repeat {i + 1}/{a.repeats} done")
    without, with_ = median(times["without"]), median(times["with"])
    per_step = median(in_loop) + median(handover)
    rgb_w, rgb_h = g.latent_width, g.latent_height
    table = Table(f"{workload}, {dtype} ({WORKLOADS[workload].shape}, latents {list(g.latent_shape)}; {a.device}; "
                  f"{a.steps} steps a run, medians of {a.repeats})",
                  ["step ms", "preview in the loop ms", "of a step", "first preview of a job (stored at once) ms",
                   "step with previews ms (whole runs)", "preview pixels"])
    table.add(num(without * 1e3, 1), num(per_step * 1e3, 3), f"{per_step / without:.2%}",
              num(max(handover) * 1e3, 2), f"{num(with_ * 1e3, 1)} ({(with_ - without) / without:+.1%})",
              f"{rgb_w}x{rgb_h}")
    table.notes.append("The preview in the loop: the projection of the denoised estimate's middle frame on the "
                       "device, its copy to the host and the hand-over to the server's writer thread, timed inside "
                       "the steps (medians per step); the writer stores it (a PNG) off the loop, but for a job's "
                       "first. Whole runs with and without previews differ by more than that on a shared machine: "
                       "the other processes' noise.")
    return table, {"workload": workload, "dtype": dtype, "steps": a.steps, "step_s": times, "in_loop_s": in_loop,
                   "handover_s": handover}


def run(a: argparse.Namespace) -> Report:
    tables, raw = [], []
    for workload in a.workload:
        for dtype in a.dtype:
            t, r = measure(a, workload, dtype)
            tables.append(t)
            raw.append(r)
    return Report(tables, raw)
