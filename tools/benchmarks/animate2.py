"""Wan-Animate 2 beside Wan-Animate (1) at the same transformer widths: the time of a video of 1 and 2 segments of
each kind, the time a segment after the first costs, and where a segment's seconds go, with the share of Wan-Animate
2's reference pass (the DiT run once per segment over the driving frames, writing the reference keys and values its
steps attend to).

Workloads: animate-1.3b (Wan2.2-Animate's parts at the 1.3B's widths: 30 blocks, 12 heads of 128, 512x512 faces) and
animate2-1.3b (WanAnimate2Transformer3DModel at the same widths, from a modular directory), random weights, the real
VAE, 9-frame segments of 128x128, bf16 by default. Each video is one `Pipeline.generate` call with every program
compiled first (`Pipeline.prepare`) and one untimed video made first, the kinds and segment counts interleaved over
--repeats; a video of n segments is 1 + 8n driving (pose) frames, carrying one frame. Both at guidance 1 by default
(one DiT pass a step: Wan-Animate's default; a distilled Wan-Animate 2's), 4 steps (--steps, --guidance).

The parts are timed by wrapping the pipeline's calls (each waits for its result): the VAE encodes (Animate: the pose
and conditioning videos; Animate 2: the driving window and the conditioning video), Animate's face_motion program,
Animate 2's reference pass (`reference_step`), the denoising steps (the step runner's run) and the decode.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from .animate import _timed
from .common import NEGATIVE, PROMPT, WORKLOADS, Report, Table, add_common, bundle, log, median, num, ratio

COUNTS = (1, 2)
KINDS = {"animate": "animate-1.3b", "animate-2": "animate2-1.3b"}
TITLES = {"animate": "Wan-Animate (1)", "animate-2": "Wan-Animate 2"}
PARTS = ("encode_video", "face_motion", "reference", "steps", "decode")
LABELS = {"encode_video": "VAE encodes (pose or driving window, conditioning video)",
          "face_motion": "face_motion program (Animate: motion + face encoders)",
          "reference": "reference pass (Animate 2: the DiT over the driving window, its K/V cached)",
          "steps": "denoising steps", "decode": "VAE decode"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=2, dtypes=("bf16",))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=1.0)


def _instrument(pipe: Any, parts: dict[str, float]) -> None:
    """Time this pipeline's VAE encodes and decodes, its face_motion and reference_step programs (each call waits
    for its result), into `parts`."""
    for part in ("encode_video", "decode"):
        setattr(pipe, part, _timed(getattr(type(pipe), part).__get__(pipe), parts, part))
    call = type(pipe).call.__get__(pipe)
    pipe.call = lambda program, g: _timed(call(program, g), parts, "face_motion") if program == "face_motion" \
        else call(program, g)
    bundle_call = pipe.bundle.call
    pipe.bundle.call = lambda name, *a, **kw: _timed(bundle_call(name, *a, **kw), parts, "reference") \
        if name.startswith("reference_step") else bundle_call(name, *a, **kw)


def _steps_timer(parts: dict[str, float]) -> Callable[[], None]:
    """Time the step runner's runs (every loop's steps go through runtime.steps.run) into `parts`; returns the undo."""
    from runtime import steps

    original = steps.run
    steps.run = _timed(original, parts, "steps")

    def undo() -> None:
        steps.run = original

    return undo


def _inputs(kind: str, n: int, wl: Any, rng: Any) -> dict[str, Any]:
    """A video of n segments' inputs: 1 + 8n pose (and face) frames, or driving frames, of the workload's size."""
    frames = 1 + n * (wl.frames - 1)
    video = rng.integers(0, 255, (frames, wl.height, wl.width, 3), "uint8")
    if kind == "animate":
        return {"pose_video": video, "face_video": rng.integers(0, 255, (frames, 512, 512, 3), "uint8")}
    from PIL import Image

    return {"driving_video": [Image.fromarray(f) for f in video]}


def run(a: argparse.Namespace) -> Report:
    import numpy as np
    from PIL import Image

    import runtime

    tables, raw = [], {}
    for dtype in a.dtype:
        pipes, parts = {}, {}
        for kind, name in KINDS.items():
            pipes[kind] = runtime.load(bundle(a.work, WORKLOADS[name], dtype, a.device))
            pipes[kind].prepare(magcache=False)
            parts[kind] = {}
            _instrument(pipes[kind], parts[kind])
        rng = np.random.default_rng(0)
        image = Image.fromarray(rng.integers(0, 255, (128, 128, 3), np.uint8))  # square: the 128x128 frame
        for kind, pipe in pipes.items():  # a first video each, untimed: what the first call does once (host setup)
            pipe.generate(PROMPT, NEGATIVE, image=image, steps=1, guidance=a.guidance, progress=False,
                          **_inputs(kind, 1, WORKLOADS[KINDS[kind]], rng))
        totals = {(k, n): [] for k in KINDS for n in COUNTS}
        split: dict[tuple[str, int], list[dict[str, float]]] = {key: [] for key in totals}
        for i in range(a.repeats):
            for n in COUNTS:
                for kind, pipe in pipes.items():
                    wl = WORKLOADS[KINDS[kind]]
                    inputs = _inputs(kind, n, wl, rng)
                    parts[kind].clear()
                    undo = _steps_timer(parts[kind])
                    try:
                        t0 = time.perf_counter()
                        pipe.generate(PROMPT, NEGATIVE, image=image, steps=a.steps, guidance=a.guidance,
                                      progress=False, **inputs)
                        totals[kind, n].append(time.perf_counter() - t0)
                    finally:
                        undo()
                    split[kind, n].append(dict(parts[kind]))
            log(f"{dtype} repeat {i + 1}/{a.repeats} done")
        wl = WORKLOADS[KINDS["animate"]]
        table = Table(f"a video of 1 and 2 segments, Wan-Animate beside Wan-Animate 2 at the 1.3B widths, {dtype} "
                      f"({wl.shape} per segment; {a.steps} steps, guidance {a.guidance:g}; {a.device}; median of "
                      f"{a.repeats})", ["kind", "1 segment s", "2 segments s", "a segment after the first s",
                                        "per segment against Wan-Animate"])
        marginal = {k: median(totals[k, 2]) - median(totals[k, 1]) for k in KINDS}
        for kind in KINDS:
            table.add(TITLES[kind], num(median(totals[kind, 1]), 2), num(median(totals[kind, 2]), 2),
                      num(marginal[kind], 2), ratio(marginal[kind], marginal["animate"]))
        table.notes.append("A segment after the first: T(2) - T(1); the first also pays the request's encode (prompt, "
                           "CLIP, the character's latents; Animate 2 also the reference prompt's), once per video.")
        tables.append(table)
        per = Table(f"where a segment's seconds go (a 2-segment video, per segment): {dtype}, median of {a.repeats}",
                    ["part", "Wan-Animate s", "share", "Wan-Animate 2 s", "share"])
        shares = {}
        for part in (*PARTS, "rest"):
            row = [LABELS.get(part, "the rest (the request's encode, host work)")]
            for kind in KINDS:
                total = median(totals[kind, 2])
                seconds = median([p.get(part, 0.0) for p in split[kind, 2]]) if part != "rest" else \
                    total - sum(median([p.get(q, 0.0) for p in split[kind, 2]]) for q in PARTS)
                shares[kind, part] = seconds / total
                row += [num(seconds / 2, 2), f"{100 * seconds / total:.0f}%"]
            per.add(*row)
        per.notes.append(f"Wan-Animate 2's reference pass is {100 * shares['animate-2', 'reference']:.0f}% of its "
                         f"segment's time ({a.steps} steps at guidance {a.guidance:g}: one pass against "
                         f"{a.steps} step passes).")
        tables.append(per)
        raw[dtype] = {"totals": {f"{k}/{n}": v for (k, n), v in totals.items()},
                      "parts": {f"{k}/{n}": v for (k, n), v in split.items()}}
    return Report(tables, raw)
