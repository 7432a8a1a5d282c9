"""Wan-Animate's segment loop: the time of a video of 1, 2 and 4 segments (linear in the count?) and where a
segment's time goes, on the animate-1.3b workload (Animate's parts at the 1.3B widths, 512x512 faces, 9-frame
segments of 128x128: a pose video of 1 + 8n frames is n segments).

Each video is one `Pipeline.generate` call, every program compiled first (`Pipeline.prepare`); the counts are
interleaved over --repeats. By default 4 steps at guidance 1 (a distilled Animate's recipe; --steps, --guidance).
The parts are timed by wrapping the pipeline's calls (each waits for its result): the request's encode (prompt,
CLIP, the character's latents, once), the VAE encodes of the pose and conditioning videos, the face_motion
program, the denoising loop and the decode (each once per segment).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from .common import NEGATIVE, PROMPT, WORKLOADS, Report, Table, add_common, bundle, log, median, num, ratio

COUNTS = (1, 2, 4)
PARTS = ("encode", "encode_video", "face_motion", "denoise", "decode")
LABELS = {"encode": "request: prompt, CLIP, character latents (once)", "encode_video": "VAE encodes: pose, "
          "conditioning video", "face_motion": "face_motion program", "denoise": "denoising steps",
          "decode": "VAE decode"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=3, dtypes=("bf16",))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=1.0)


def _timed(fn: Callable[..., Any], into: dict[str, float], part: str) -> Callable[..., Any]:
    import jax

    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        into[part] = into.get(part, 0.0) + time.perf_counter() - t0
        return out

    return run


def _instrument(pipe: Any, parts: dict[str, float]) -> None:
    for part in ("encode", "encode_video", "denoise", "decode"):
        setattr(pipe, part, _timed(getattr(type(pipe), part).__get__(pipe), parts, part))
    call = type(pipe).call.__get__(pipe)
    pipe.call = lambda program, g: _timed(call(program, g), parts, "face_motion") if program == "face_motion" \
        else call(program, g)


def run(a: argparse.Namespace) -> Report:
    import numpy as np
    from PIL import Image

    import runtime

    wl = WORKLOADS["animate-1.3b"]
    tables, raw = [], {}
    for dtype in a.dtype:
        pipe = runtime.load(bundle(a.work, wl, dtype, a.device))
        pipe.prepare(magcache=False)
        parts: dict[str, float] = {}
        _instrument(pipe, parts)
        rng = np.random.default_rng(0)
        image = Image.fromarray(rng.integers(0, 255, (160, 120, 3), np.uint8))
        prev, length = 1, wl.frames
        totals: dict[int, list[float]] = {n: [] for n in COUNTS}
        split: dict[int, list[dict[str, float]]] = {n: [] for n in COUNTS}
        for i in range(a.repeats):
            for n in COUNTS:
                frames = prev + n * (length - prev)
                pose = rng.integers(0, 255, (frames, wl.height, wl.width, 3), np.uint8)
                face = rng.integers(0, 255, (frames, 512, 512, 3), np.uint8)
                parts.clear()
                t0 = time.perf_counter()
                pipe.generate(PROMPT, NEGATIVE, image=image, pose_video=pose, face_video=face, steps=a.steps,
                              guidance=a.guidance, progress=False)
                totals[n].append(time.perf_counter() - t0)
                split[n].append(dict(parts))
            log(f"{dtype} repeat {i + 1}/{a.repeats} done")
        one = median(totals[1])
        table = Table(f"a Wan-Animate video of 1, 2 and 4 segments: animate-1.3b, {dtype} ({wl.shape} per segment; "
                      f"{a.steps} steps, guidance {a.guidance:g}; {a.device}; median of {a.repeats})",
                      ["segments", "pose frames", "total s", "per segment s", "total / (n x 1 segment)"])
        for n in COUNTS:
            total = median(totals[n])
            table.add(str(n), str(prev + n * (length - prev)), num(total, 2), num(total / n, 2), ratio(total, n * one))
        marginal = (median(totals[COUNTS[-1]]) - one) / (COUNTS[-1] - 1)
        table.notes.append(f"A segment after the first costs {marginal:.2f} s: (T(4) - T(1)) / 3; the first also "
                           "pays the request's encode, once per video.")
        tables.append(table)
        parts_table = Table(f"where the seconds of a {COUNTS[-1]}-segment video go: animate-1.3b, {dtype} (median of "
                            f"{a.repeats})", ["part", "s per video", "s per segment", "share"])
        last = split[COUNTS[-1]]
        total = median(totals[COUNTS[-1]])
        for part in PARTS:
            s = median([p.get(part, 0.0) for p in last])
            parts_table.add(LABELS[part], num(s, 2), "-" if part == "encode" else num(s / COUNTS[-1], 2),
                            f"{100 * s / total:.0f}%")
        other = total - sum(median([p.get(part, 0.0) for p in last]) for part in PARTS)
        parts_table.add("the rest (host: padding, resizing, masks, the loop)", num(other, 2), "-",
                        f"{100 * other / total:.0f}%")
        tables.append(parts_table)
        raw[dtype] = {"totals": {str(n): v for n, v in totals.items()},
                      "parts": {str(n): v for n, v in split.items()}}
    return Report(tables, raw)
