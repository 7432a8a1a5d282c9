"""Time to first frame: a segment loop's video streamed live (runtime/hls.py: each segment decoded as it ends, then
encoded as an MPEG-TS segment and written with its playlist) against the same video made whole, where the first
frame comes with the last.

Workloads: a 4-segment diffusion forcing video on df-1.3b (69 frames: 21-frame segments at overlap_history 5), a
4-segment Wan-Animate video on animate-1.3b (33 pose frames: 9-frame segments, one frame carried) and a 3-chunk Helios
video on helios-1.3b (97 frames: 33-frame chunks, each decoded alone as diffusers does). Each is one
`pipe.generate` call, every program compiled first; "streamed" passes `on_frames` to an HlsWriter on a directory (what
`runtime generate --stream DIR` does), "whole" is the call without it (diffusion forcing with `low_memory`, which
decodes the whole video once after the last segment, as before streams; Animate and Helios decode each segment or
chunk as it ends either way, and hand nothing out until the end). Seconds are from the call's start; runs interleaved over --repeats, medians.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

from .common import NEGATIVE, PROMPT, WORKLOADS, Report, Table, add_common, bundle, log, median, num, ratio

SEGMENTS = 4
OVERLAP = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=2, dtypes=("bf16",))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--loops", nargs="+", default=["forcing", "animate", "helios"],
                   choices=["forcing", "animate", "helios"])


def _forcing_call(a: argparse.Namespace) -> tuple[str, str, dict[str, Any]]:
    wl = WORKLOADS["df-1.3b"]
    latent = (wl.frames - 1) // 4 + 1
    step = latent - ((OVERLAP - 1) // 4 + 1)
    frames = 4 * (latent + (SEGMENTS - 1) * step - 1) + 1
    return "df-1.3b", f"diffusion forcing, {frames} frames in {SEGMENTS} segments of {wl.frames}", {
        "num_frames": frames, "overlap_history": OVERLAP}


def _animate_call(a: argparse.Namespace) -> tuple[str, str, dict[str, Any]]:
    import numpy as np
    from PIL import Image

    wl = WORKLOADS["animate-1.3b"]
    rng = np.random.default_rng(0)
    frames = 1 + SEGMENTS * (wl.frames - 1)
    return "animate-1.3b", f"Wan-Animate, {frames} pose frames in {SEGMENTS} segments of {wl.frames}", {
        "image": Image.fromarray(rng.integers(0, 255, (160, 120, 3), np.uint8)),
        "pose_video": rng.integers(0, 255, (frames, wl.height, wl.width, 3), np.uint8),
        "face_video": rng.integers(0, 255, (frames, 512, 512, 3), np.uint8)}


def _helios_call(a: argparse.Namespace) -> tuple[str, str, dict[str, Any]]:
    wl = WORKLOADS["helios-1.3b"]
    chunks = SEGMENTS - 1
    frames = (chunks * wl.frames - 1) // 4 * 4 + 1
    return "helios-1.3b", f"Helios, {frames} frames in {chunks} chunks of {wl.frames}", {"num_frames": frames}


CALLS = {"forcing": _forcing_call, "animate": _animate_call, "helios": _helios_call}


def run(a: argparse.Namespace) -> Report:
    import runtime
    from runtime.hls import HlsWriter, directory_sink

    tables, raw = [], {}
    for dtype in a.dtype:
        table = Table(f"time to the first playable segment against the whole video ({dtype}; {a.steps} steps, "
                      f"guidance {a.guidance:g}; {a.device}; median of {a.repeats})",
                      ["video", "segments written", "first segment s", "whole video s (streamed)",
                       "whole video s (not streamed)", "first / whole", "streamed / not streamed"])
        for loop in a.loops:
            name, about, kw = CALLS[loop](a)
            wl = WORKLOADS[name]
            pipe = runtime.load(bundle(a.work, wl, dtype, a.device))
            pipe.prepare(magcache=False)
            fps = pipe.manifest.defaults.fps
            runs: dict[str, list[dict[str, float]]] = {"streamed": [], "whole": []}
            for i in range(a.repeats):
                for how in runs:
                    marks: list[float] = []
                    with tempfile.TemporaryDirectory(prefix="wan-aot-bench-stream-") as d:
                        extra: dict[str, Any] = {"low_memory": loop == "forcing"} if how == "whole" else {}
                        if how == "streamed":
                            writer = HlsWriter(directory_sink(d), fps)

                            def on_frames(frames: Any, writer: HlsWriter = writer, marks: list[float] = marks
                                          ) -> None:
                                writer.add(frames)
                                marks.append(time.perf_counter())

                            extra["on_frames"] = on_frames
                        t0 = time.perf_counter()
                        pipe.generate(PROMPT, NEGATIVE, steps=a.steps, guidance=a.guidance, progress=False, **kw,
                                      **extra)
                        total = time.perf_counter() - t0
                        if how == "streamed":
                            writer.end()
                    runs[how].append({"total": total, "first": (marks[0] - t0) if marks else total,
                                      "segments": len(marks)})
                log(f"{loop} {dtype} repeat {i + 1}/{a.repeats} done")
            first = median([r["first"] for r in runs["streamed"]])
            streamed = median([r["total"] for r in runs["streamed"]])
            whole = median([r["total"] for r in runs["whole"]])
            table.add(f"{about} ({wl.shape})", str(int(runs["streamed"][0]["segments"])), num(first, 2),
                      num(streamed, 2), num(whole, 2), ratio(first, streamed), ratio(streamed, whole))
            raw[f"{loop}:{dtype}"] = runs
        table.notes.append("Not streamed, the first frame arrives with the last: at the whole video's seconds. A "
                           "streamed segment's time includes its H.264 encode and its write (and the playlist's).")
        tables.append(table)
    return Report(tables, raw)
