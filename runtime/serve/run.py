"""One job's run: its params and files to the pipeline's call for its kind (an image edit, a segment loop, the
one-shape kinds' encode, denoise and decode), with its progress, previews, cancel checks and live frames; the video
written. Every process of a multi-host slice runs it, with the same callbacks at the same points: process 0's worker
(runtime/serve/worker.py) around a claimed job, the others as they follow process 0 (runtime/serve/follower.py)."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import helios
from . import derive, images


class Cancelled(Exception):
    """A client cancelled or deleted the running job: the run stops at the boundary it reached and stores nothing."""


def run_job(pipe: Any, params: dict[str, Any], image_bytes: list[bytes], video: Path | None,
            on_progress: Callable[[int], None] = lambda p: None,
            on_step_time: Callable[[float], None] = lambda s: None,
            on_stage: Callable[[str], None] = lambda stage: None,
            on_preview: Callable[[Any], None] = lambda rgb: None,
            check: Callable[[], None] = lambda: None,
            on_lora: Callable[[dict[str, Any] | None], None] = lambda switched: None,
            on_frames: Callable[[Any], None] = lambda frames: None) -> Any:
    """Generate one job's video (every process of a multi-host job runs this, with the same callbacks called at the
    same points; only process 0 writes) and return its frames (F, H, W, 3) in [0, 1]. `on_progress` follows the
    denoising steps, `on_stage` each finished stage ("encode", "denoise", "decode"), `on_preview` gets each step's
    estimate of the middle frame (Pipeline.denoise); `check` runs after every step and stage and raises to stop;
    `on_lora` gets the job's LoRA set taken up (what the switch did, or None where the weights held it already);
    `on_frames` the video's frames in order, as they are final ((F, H, W, 3) or (1, F, H, W, 3) each: a segment
    loop's each segment's, as it is decoded; the one-shape kinds' whole video at the end), which join into the video
    returned."""
    from ..magcache import MagCache
    from ..video import write_video
    from .loras import specs

    # the server's own --lora adapters, then the job's: switched to only where the weights hold another set
    on_lora(pipe.use_loras([*pipe.base_loras, *specs(params.get("lora"))]))
    media = derive.sources(params, media_of(params, image_bytes))
    s = pipe.settings(params["seed"], params["steps"], params["guidance"], params["flow_shift"], params["guidance_2"],
                      params.get("sampler"), params.get("sigmas"))
    magcache = MagCache(**params["magcache"]) if params.get("magcache") else None
    last = [time.perf_counter()]

    def steps_done(done: int, total: int) -> None:
        now = time.perf_counter()
        on_step_time(now - last[0])
        last[0] = now
        on_progress(min(99, int(100 * done / total)))
        check()

    def stage_done(stage: str) -> None:
        on_stage(stage)
        check()

    if params.get("task") == images.TASK:  # POST /v1/images/edits: pipe.edit_image, its PNG (runtime/serve/images.py)
        return images.run_edit(pipe, params, media, s, magcache, steps_done, stage_done, on_preview, check, video)
    if pipe.kind.forcing:  # any length, in overlapping segments: runtime/forcing.py
        source = media.pop("_source", None)  # an extension's (derive.py's "forcing" way): the video continued
        live = on_frames if source is None else derive.forcing_live(params, len(source), on_frames)
        check()
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"),
                               last_image=media.get("last_image"), video=source, num_frames=params["frames"],
                               overlap_history=params.get("overlap_history"), ar_step=params.get("ar_step") or 0,
                               causal_block_size=params.get("causal_block_size"),
                               addnoise_condition=params.get("addnoise_condition") or 0, fps=params["fps"],
                               seed=s.seed, steps=s.steps, guidance=s.guidance, flow_shift=s.flow_shift,
                               sampler=s.sampler, sigmas=s.sigmas, progress=False, size=params.get("size"),
                               on_step=steps_done, on_preview=on_preview,
                               decoder=params.get("decoder") or "full", on_frames=live)[0]
        if source is not None:  # the source, then the new part after the frames it re-decodes (those shared)
            frames = derive.forcing_joined(params, len(source), frames)
        stage_done("decode")
        if video is not None:
            write_video(frames, video, fps=params["fps"])
        return frames
    if pipe.kind.helios:  # any length, in chunks: runtime/helios.py
        source = media.get("_source")  # an extension's (derive.py's "helios" way): the video continued
        if source is not None:  # the stream shows the video the job writes: the source, then the new chunks
            on_frames(derive.joined(params, dict(media), np.zeros((0, *_frame_shape(pipe, params)), np.float32))[None])
        check()
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"), video=source,
                               num_frames=params["frames"], seed=s.seed, steps=s.steps, guidance=s.guidance,
                               sampler=params.get("sampler"), sigmas=s.sigmas, progress=False,
                               size=params.get("size"), on_step=steps_done, on_preview=on_preview,
                               decoder=params.get("decoder") or "full", on_frames=on_frames,
                               **{name: params.get(name) for name in helios.SETTINGS})[0]
        frames = derive.joined(params, media, frames)  # an extension's source first
        stage_done("decode")
        if video is not None:
            write_video(frames, video, fps=params["fps"])
        return frames
    if pipe.kind.far:  # causal chunks, each's frames streamed as made: runtime/far.py
        check()
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"), seed=s.seed,
                               steps=s.steps, guidance=s.guidance, flow_shift=s.flow_shift, sampler=s.sampler,
                               sigmas=s.sigmas, progress=False, size=params.get("size"), frames=params.get("frames"),
                               on_step=steps_done, decoder=params.get("decoder") or "full", on_frames=on_frames)[0]
        stage_done("decode")
        if video is not None:
            write_video(frames, video, fps=params["fps"])
        return frames
    if pipe.kind.animate2:  # the driving video's segments, each streamed as decoded: runtime/animate2.py
        check()
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"),
                               driving_video=media.get("driving_video"), prompt_ref=params.get("prompt_ref"),
                               prev_segment_conditioning_frames=params["prev_segment_conditioning_frames"],
                               driving_video_fps=params.get("driving_video_fps"), fps=params["fps"], seed=s.seed,
                               steps=s.steps, guidance=s.guidance, flow_shift=s.flow_shift, sampler=s.sampler,
                               sigmas=s.sigmas, progress=False, size=params.get("area"), on_step=steps_done,
                               on_preview=on_preview, decoder=params.get("decoder") or "full", on_frames=on_frames)[0]
        stage_done("decode")
        if video is not None:
            write_video(frames, video, fps=params["fps"])
        return frames
    if pipe.kind.animate:  # every segment: runtime/animate.py
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"),
                               pose_video=media.get("pose_video"), face_video=media.get("face_video"),
                               mode=params.get("mode") or "animate", background_video=media.get("background_video"),
                               mask_video=media.get("mask_video"),
                               prev_segment_frames=params.get("prev_segment_frames") or 1, seed=s.seed, steps=s.steps,
                               guidance=s.guidance, flow_shift=s.flow_shift, sampler=s.sampler, sigmas=s.sigmas,
                               progress=False, magcache=magcache, size=params.get("size"), frames=params.get("frames"),
                               on_step=steps_done, on_preview=on_preview,
                               decoder=params.get("decoder") or "full", on_frames=on_frames)
        stage_done("decode")
        if video is not None:
            write_video(frames[0], video, fps=params["fps"])
        return frames[0]
    remake = media.pop("remake", None)  # remix and edits: the source video, noised (derive.py)
    run = {"conditioning_scale": params.get("conditioning_scale"),
           "strength": params.get("strength") if (media.get("video") is not None and pipe.manifest.video_to_video)
           or remake is not None else None}
    # Jobs queued before bundles had several shapes carry their size but no frames: the default shape's.
    shape = {"size": params.get("size"), "frames": params.get("frames")}
    check()
    embeds = pipe.encode(params["prompt"], params["negative_prompt"], media.get("image"), media.get("last_image"),
                         **shape, **{k: media[k] for k in ("video", "mask", "reference_images") if k in media})
    if remake is not None:
        embeds["video_latents"] = derive.video_latents(pipe, remake, shape["size"], shape["frames"])
    stage_done("encode")
    steps = pipe.steps_run(embeds, s, run["strength"])  # what progress counts: video-to-video runs the last ones
    last[0] = time.perf_counter()
    latents = pipe.denoise(embeds, s.seed, s.steps, s.guidance, s.flow_shift, progress=False,
                           on_step=lambda i: steps_done(i + 1, steps), on_preview=on_preview,
                           guidance_2=s.guidance_2, magcache=magcache, sampler=s.sampler, sigmas=s.sigmas,
                           **{k: v for k, v in run.items() if v is not None}, **shape)
    stage_done("denoise")
    # extensions: the source, then the new frames
    frames = derive.joined(params, media, pipe.decode(latents, params.get("decoder") or "full")[0])
    on_frames(frames)
    stage_done("decode")
    if video is not None:
        write_video(frames, video, fps=params["fps"])
    return frames


def _frame_shape(pipe: Any, params: dict[str, Any]) -> tuple[int, int, int]:
    """(H, W, 3): the frames of a job at its size."""
    g = pipe.shape(params.get("size"))
    return (g.height, g.width, 3)


def media_of(params: dict[str, Any], files: list[bytes]) -> dict[str, Any]:
    """A job's files by what they are in the run (params["media"] names them in order, schema.MEDIA_ROLES): `image`
    and `last_image` (PIL images), `video` and `mask` (PIL frames), `reference_images` (a list); a derived job's
    source video (derive.SOURCE_ROLES, PIL frames). Jobs queued before videos name none: their files are the first
    image, then the last."""
    from PIL import Image

    from .schema import VIDEO_ROLES, read_video_bytes

    roles = params.get("media") or ["image", "last_image"][: len(files)]
    out: dict[str, Any] = {}
    for role, data in zip(roles, files, strict=True):
        if role in VIDEO_ROLES or role in derive.SOURCE_ROLES:
            out[role] = read_video_bytes(data, role)
        elif role == "reference_image":
            out.setdefault("reference_images", []).append(Image.open(io.BytesIO(data)))
        else:
            out[role] = Image.open(io.BytesIO(data))
    return out
