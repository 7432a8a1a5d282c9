"""Diffusion forcing (SkyReels-V2 DF, runtime/forcing.py): the time of a video of 1, 2 and 4 segments (linear in the
count?) and what the asynchronous mode costs against the synchronous one, on the df-1.3b workload (the 1.3B DiT with
the fps embedding, random weights; 21-frame segments of 128x128, 6 latent frames).

Each video is one `Pipeline.generate` call, every program compiled first (`Pipeline.prepare`); the runs are
interleaved over --repeats. Segments: 21, 37 and 69 frames at overlap_history 5 (each later segment carries 2 latent
frames and makes 4 new). Modes, one 21-frame segment: synchronous (N rows of the timestep matrix, one DiT call each),
and asynchronous with causal blocks of 3 and 2 latent frames (2 and 3 blocks) at ar_step 2: N + (blocks - 1) x 2 rows
under block-causal attention. By default 6 steps at guidance 5 (--steps, --guidance). The denoising rows are timed
by wrapping the step program's calls (each waits for its result); the rest is the encode and the VAE decode.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from .common import NEGATIVE, PROMPT, WORKLOADS, Report, Table, add_common, bundle, log, median, num, ratio

COUNTS = (1, 2, 4)
OVERLAP = 5
MODES = {"synchronous": {}, "async, blocks of 3": {"ar_step": 2, "causal_block_size": 3},
         "async, blocks of 2": {"ar_step": 2, "causal_block_size": 2}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=2, dtypes=("bf16",))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--guidance", type=float, default=5.0)


def _rows_timer(pipe: Any, into: dict[str, float]) -> None:
    """Time every call of the denoise programs (and count them) through the bundle's `call`."""
    import jax

    call = type(pipe.bundle).call.__get__(pipe.bundle)

    def timed(name: str) -> Any:
        fn = call(name)
        if not name.startswith("denoise_step"):
            return fn

        def run(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            into["rows_s"] = into.get("rows_s", 0.0) + time.perf_counter() - t0
            into["rows"] = into.get("rows", 0) + 1
            return out

        return run

    pipe.bundle.call = timed


def run(a: argparse.Namespace) -> Report:
    import runtime

    wl = WORKLOADS["df-1.3b"]
    tables, raw = [], {}
    for dtype in a.dtype:
        pipe = runtime.load(bundle(a.work, wl, dtype, a.device))
        pipe.prepare(magcache=False)
        parts: dict[str, float] = {}
        _rows_timer(pipe, parts)
        latent = (wl.frames - 1) // 4 + 1
        step = latent - ((OVERLAP - 1) // 4 + 1)
        frames = {n: 4 * (latent + (n - 1) * step - 1) + 1 for n in COUNTS}
        runs = [("segments", n, {"num_frames": frames[n], "overlap_history": OVERLAP}) for n in COUNTS]
        runs += [("mode", m, {"num_frames": wl.frames, **kw}) for m, kw in MODES.items()]
        times: dict[tuple[str, Any], list[dict[str, float]]] = {(k, n): [] for k, n, _ in runs}
        for i in range(a.repeats):
            for kind, name, kw in runs:
                parts.clear()
                t0 = time.perf_counter()
                pipe.generate(PROMPT, NEGATIVE, steps=a.steps, guidance=a.guidance, progress=False, **kw)
                times[kind, name].append({"total": time.perf_counter() - t0, **parts})
            log(f"{dtype} repeat {i + 1}/{a.repeats} done")

        def med(key: tuple[str, Any], part: str, times: dict[Any, list[dict[str, float]]] = times) -> float:
            return median([t[part] for t in times[key]])

        one = med(("segments", 1), "total")
        table = Table(f"a diffusion forcing video of 1, 2 and 4 segments: df-1.3b, {dtype} ({wl.shape} per segment, "
                      f"overlap_history {OVERLAP}; {a.steps} steps, guidance {a.guidance:g}; {a.device}; median of "
                      f"{a.repeats})", ["segments", "frames", "total s", "per segment s", "DiT rows",
                                        "denoising s", "total / (n x 1 segment)"])
        for n in COUNTS:
            key = ("segments", n)
            total = med(key, "total")
            table.add(str(n), str(frames[n]), num(total, 2), num(total / n, 2), str(int(med(key, "rows"))),
                      num(med(key, "rows_s"), 2), ratio(total, n * one))
        marginal = (med(("segments", COUNTS[-1]), "total") - one) / (COUNTS[-1] - 1)
        table.notes.append(f"A segment after the first costs {marginal:.2f} s: (T(4) - T(1)) / 3; the first also pays "
                           "the prompt's encode, and the one VAE decode grows with the frames.")
        tables.append(table)
        sync = ("mode", "synchronous")
        modes = Table(f"the asynchronous mode against the synchronous one: df-1.3b, {dtype} (one {wl.frames}-frame "
                      f"segment; {a.steps} steps; median of {a.repeats})",
                      ["mode", "DiT rows", "denoising s", "s per row", "total s", "total / synchronous"])
        for m in MODES:
            key = ("mode", m)
            rows = med(key, "rows")
            modes.add(m, str(int(rows)), num(med(key, "rows_s"), 2), num(med(key, "rows_s") / rows, 3),
                      num(med(key, "total"), 2), ratio(med(key, "total"), med(sync, "total")))
        modes.notes.append("Rows: N steps synchronous, N + (blocks - 1) x ar_step asynchronous (each a DiT call over "
                           "the whole segment). On XLA (CPU, GPU) block-causal attention masks scores; the TPU kernel "
                           "skips the masked kv blocks.")
        tables.append(modes)
        raw[dtype] = {f"{k}:{n}": v for (k, n), v in times.items()}
    return Report(tables, raw)
