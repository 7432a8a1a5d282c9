"""Wan-Animate 2 at any length (kinds.py "animate-2", "animate-2-distilled"): diffusers' WanAnimate2ModularPipeline
(WanAnimate2DistilledModularPipeline) as its blocks run it, on the one step runner (runtime/steps.py).

A character image is moved by a driving video. A bundle shape is one segment of S frames (`--frames` at export:
segment_frame_length); its sizes are the areas a video can be made at. Per run, once: the frame size (the shape's
area at the image's aspect; it must be one of the bundle's sizes), the letterboxed image's CLIP features and VAE
latents, the prompt's and the reference prompt's embeddings, the cross-attention keys and values of both (the
reference prompt's with the driving video's first frame's CLIP features). Per segment k (runtime/animate2_media.py
for the inputs):

    the driving frames [k (S - prev), k (S - prev) + S) VAE-encoded; the `reference_step` program runs the DiT over
    them once (timestep 1, the reference prompt) and writes each block's keys and values into the reference cache;
    the conditioning video (zeros, its first prev frames the video's last prev frames made so far, k > 0)
    VAE-encoded under the frame mask, after the image's latent frame; the segment's own initial noise
    (16, L + 1, h, w); the steps (the sampler starts afresh), each attending to the cache; the decode of latent
    frames 1.. (frame 0 is the image's slot); from k > 0 the first prev frames are dropped.

The video is cut to the driving video's length and cropped to the image's box (the letterbox bars off).

Edge cases, as diffusers 0.42.1 handles them, and where it fails:
- a driving video that does not end on a segment boundary, or is shorter than a segment, is padded with its own last
  frames mirrored ([0 1 2 3 4] -> [0 1 2 3 4 | 4 3 2]) to whole segments, and the output cut back. Where the padding
  is longer than the video (fewer than about S / 2 frames), diffusers' mirror slice comes out short and it fails
  ("Each sample must hold exactly `seq_len` tokens"); here the mirror goes on back and forth to the length needed;
- a video of prev frames or fewer makes zero segments in diffusers (it fails at the end): refused here in one line;
- the frames carried into segment k are the last prev frames of the video made so far. diffusers takes the last prev
  of the segment before's frames after it dropped its first prev: the same frames while S - prev >= prev; with more
  carried than that (5 of 9), its third segment gets fewer than prev frames and fails ("Each sample must hold
  exactly `seq_len` tokens"). The runtime runs it with the video's last prev frames (the same rule, which diffusers
  follows in every case it runs).

It takes the Pipeline front (runtime/pipeline.py) as `pipe` and calls its public methods; it imports no loop and not
the front."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import animate2_media as media
from . import images, scheduler, video_input
from . import steps as runner
from .animate import frame_mask
from .distributed import fetch
from .errors import UserError
from .noise import seed_noise, segment_noise

Pipeline = Any  # the front (runtime/pipeline.py), which imports this loop: the loop calls its public methods


def pick_shape(pipe: Pipeline, image_size: tuple[int, int], size: Any, frames: int | None) -> Any:
    """The bundle shape a run makes: the requested area (`size`'s, or each of the bundle's sizes in turn, the
    default first) at the image's aspect must resolve to one of the bundle's sizes; UserError naming them if not."""
    multiple = 2 * pipe.geometry.spatial_scale
    shapes = pipe.manifest.shapes
    sizes = sorted({(g.width, g.height) for g in shapes}, key=lambda wh: (wh != (pipe.geometry.width,
                                                                                 pipe.geometry.height), wh))
    asked = [pipe.shape(size, frames)] if size is not None else [pipe.shape(f"{w}x{h}", frames) for w, h in sizes]
    made = [media.frame_size(image_size, g.width * g.height, multiple) for g in asked]
    for want in made:
        if want in sizes:
            return pipe.shape(f"{want[0]}x{want[1]}", frames)
    names = ", ".join(f"{w}x{h}" for w, h in sizes)
    raise UserError(f"the image ({image_size[0]}x{image_size[1]}) makes a {made[0][0]}x{made[0][1]} video (Wan-Animate "
                    f"2 keeps its aspect), and this bundle makes {names}: export the bundle for that size, or give "
                    "an image of one of its aspects")


def driving_frames(driving_video: Any, driving_video_fps: float | None, fps: float) -> list[Any]:
    """The driving video's PIL frames, resampled from `driving_video_fps` to `fps` (nearest frame) when given."""
    if driving_video is None:
        raise UserError("Wan-Animate 2 needs a driving video (driving_video=..., --driving-video FILE)")
    frames = driving_video if isinstance(driving_video, list) and driving_video and \
        all(hasattr(f, "size") and hasattr(f, "mode") for f in driving_video) else \
        video_input.load_frames(driving_video, "driving video")
    frames = [f if f.mode == "RGB" else f.convert("RGB") for f in frames]
    if driving_video_fps is not None:
        if not np.isfinite(driving_video_fps) or driving_video_fps <= 0:
            raise UserError(f"driving_video_fps must be a positive number, got {driving_video_fps!r}")
        frames = [frames[i] for i in media.frame_indices(len(frames), driving_video_fps, fps)]
    return frames


def initial_noise(latents: Any, count: int, shape: tuple[int, ...]) -> list[np.ndarray | None]:
    """Each segment's initial noise: `latents` None, one array (the first segment's) or one per segment, each as
    diffusers draws it, (z, L + 1, h, w), or with the batch axis in front."""
    def batched(x: Any) -> Any:
        a = np.asarray(x, np.float32)
        return a[None] if a.ndim == len(shape) - 1 else a

    if latents is None:
        return [None] * count
    given = [batched(x) for x in latents] if isinstance(latents, (list, tuple)) else batched(latents)
    return segment_noise(given, count, shape)


def generate(pipe: Pipeline, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
             image: Any = None, driving_video: Any = None, prompt_ref: str | None = None,
             prev_segment_conditioning_frames: int = 1, driving_video_fps: float | None = None,
             fps: float | None = None, seed: int = 0, steps: int | None = None, guidance: float | None = None,
             flow_shift: float | None = None, guidance_2: float | None = None, sampler: str | None = None,
             sigmas: Sequence[float] | None = None, latents: Any = None, progress: bool = True, magcache: Any = None,
             size: Any = None, frames: int | None = None, low_memory: bool = False,
             on_step: Callable[[int, int], None] | None = None,
             on_preview: Callable[[np.ndarray], None] | None = None, decoder: str = "full",
             on_frames: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """frames (B, n, H', W', 3) float32 in [0, 1]: n the driving video's frames (after resampling to `fps`), H' x W'
    the image's box in the frame size (see the module docstring). `prompt_ref` (default diffusers' 人物动作的参考视频)
    conditions the reference pass; `driving_video_fps` resamples the driving video to `fps` (default the bundle's,
    24); `latents` one initial noise per segment (16, L + 1, h, w), as diffusers' randn_tensor draws them (default:
    from `seed`); `size` a requested area ("WxH", one of the bundle's sizes; default: each of them, the first whose
    area at the image's aspect the bundle makes). `on_frames` gets each segment's frames the video keeps, cropped, as
    soon as they are decoded. The rest as Pipeline.generate."""
    if image is None:
        raise UserError("Wan-Animate 2 needs the character's image (image=..., --image FILE)")
    if magcache is not None:
        raise UserError(f"this bundle is {pipe.kind.title}: MagCache is not for its steps (each attends to its "
                        "segment's reference cache)")
    if guidance_2 is not None:
        raise UserError(f"this bundle is {pipe.kind.title}: it has one expert, so no guidance_2")
    pipe.decoder_programs(decoder)  # a decoder the bundle lacks fails before any work
    character = images.load_image(image, "image")
    fps = pipe.manifest.defaults.fps if fps is None else fps
    pil = driving_frames(driving_video, driving_video_fps, fps)
    g = pick_shape(pipe, character.size, size, frames)
    seg = media.segments(len(pil), g.frames, prev_segment_conditioning_frames)
    s = pipe.settings(seed, steps, guidance, flow_shift, None, sampler, sigmas)
    noise = initial_noise(latents, seg.count, g.latent_shape)
    ref_text = media.DEFAULT_PROMPT_REF if prompt_ref is None else prompt_ref
    pipe.prompts(ref_text, "prompt_ref")
    multiple = 2 * g.spatial_scale
    top, left, crop_h, crop_w = media.crop_region((g.width, g.height), character.size, multiple)
    order = seg.padded()
    driving = [pil[i] for i in order]

    pipe.start_loading(s, g, image=True, prompt=prompt, negative_prompt=negative_prompt)
    plan = s.plan(pipe.scheduler_config)
    count = len(plan.timesteps)
    step_name = runner.step_program(pipe.manifest, g, 0, s.guidance)
    ref_name = pipe.program_name("reference_step", g)
    cast = runner.timestep_cast(pipe.manifest, step_name, plan.timesteps, s.sampler)
    total = count * seg.count
    bar = runner.progress_bar(total, progress, "animating")
    try:
        b = g.batch
        image_pixels = media.letterbox(character, g.width, g.height, media.IMAGE_RESAMPLE)
        first = media.letterbox(driving[0], g.width, g.height, media.VIDEO_RESAMPLE)
        clip = pipe.call("image_encoder", g)
        image_clip = np.repeat(fetch(clip(media.clip_pixels(image_pixels))).astype(np.float32), b, axis=0)
        driving_clip = np.repeat(fetch(clip(media.clip_pixels(first))).astype(np.float32), b, axis=0)
        text = pipe.encode_text(prompt, negative_prompt)
        ref = pipe.encode_text([ref_text] * b, [ref_text] * b)
        kv = pipe.prompt_kv(np.concatenate([text["prompt_embeds"], text["negative_prompt_embeds"]]), 0, None,
                            {"image_embeds": image_clip})
        kv_ref = pipe.prompt_kv(np.concatenate([ref["prompt_embeds"], ref["negative_prompt_embeds"]]), 0, None,
                                {"image_embeds": driving_clip})
        image_latents = pipe.encode_video(image_pixels[None], g)  # (1, z, 1, h, w)
        ones = np.ones((1, g.temporal_scale, *image_latents.shape[2:]), np.float32)
        image_condition = np.concatenate([ones, image_latents], axis=1)  # the image's slot: mask all ones
        if low_memory:
            pipe.unload_before("denoise")
        cache = _empty_cache(pipe, ref_name)
        made: list[np.ndarray] = []  # (B, f, H, W, 3) in [0, 1], uncropped: the video so far
        kept_total = 0
        out: list[np.ndarray] = []
        for k in range(seg.count):
            window = [media.letterbox(f, g.width, g.height, media.VIDEO_RESAMPLE) for f in driving[seg.window(k)]]
            drive = pipe.encode_video(np.stack(window), g)  # (1, z, L, h, w)
            mask = np.ones((1, g.temporal_scale, *drive.shape[2:]), np.float32)
            reference = np.repeat(np.concatenate([drive, mask, drive], axis=1), b, axis=0)
            cache = pipe.bundle.call(ref_name)(reference, kv_ref, cache)
            condition = _condition(pipe, g, seg, k, made, image_condition)
            x0 = noise[k] if noise[k] is not None else seed_noise(s.seed, k, g.latent_shape)
            done = k * count

            def per_step(i: int, cache: Any = cache) -> dict[str, Any]:
                return {"kv": kv, "guidance": np.float32(s.guidance), "row": plan.coeffs[i], "ref_cache": cache}

            def step_done(i: int, done: int = done) -> None:
                if on_step is not None:
                    on_step(done + i + 1, total)

            state = runner.initial_state(x0, scheduler.state_rows(pipe.scheduler_config.solver_order))
            final = runner.run(pipe.bundle, g, [step_name] * count, state, plan.timesteps, per_step,
                               fixed={"condition": condition}, cast=cast, on_step=step_done, bar=bar,
                               on_preview=on_preview,
                               where=lambda i, k=k: f"step {i + 1} of {count} of segment {k + 1} of {seg.count}")
            latents_ = fetch(final)[0][:, :, 1:].astype(np.float32)  # frame 0 is the image's slot
            decoded = pipe.decode(latents_, decoder)  # (B, S, H, W, 3)
            new = decoded if k == 0 else decoded[:, seg.prev:]
            made.append(new)
            keep = new[:, : seg.frames - kept_total, top:top + crop_h, left:left + crop_w]
            kept_total += keep.shape[1]
            out.append(keep)
            if on_frames is not None and keep.shape[1]:
                on_frames(keep)
        return np.concatenate(out, axis=1)
    except BaseException:
        pipe.bundle.cancel_prefetch()
        raise
    finally:
        bar.close()


def _condition(pipe: Pipeline, g: Any, seg: media.Segments, k: int, made: list[np.ndarray],
               image_condition: np.ndarray) -> np.ndarray:
    """Segment k's `condition` (B, 4 + z, L + 1, h, w): the image's slot, then the conditioning video's mask and
    latents (WanAnimate2SegmentPrevFramesStep): zeros, the first prev frames the video's last prev (k > 0)."""
    b = g.batch
    carry = seg.prev if k > 0 else 0
    tail = np.concatenate(made, axis=1)[:, -carry:] if carry else None
    conds = []
    for i in range(b if carry else 1):  # the frames carried differ per video of a batch
        video = np.zeros((g.frames, 3, g.height, g.width), np.float32)
        if tail is not None:
            video[:carry] = 2.0 * tail[i].transpose(0, 3, 1, 2) - 1.0
        conds.append(pipe.encode_video(video, g))
    latents = np.concatenate(conds) if carry else np.repeat(conds[0], b, axis=0)
    mask = frame_mask(None, g.frames, g.latent_frames, g.latent_height, g.latent_width, carry, g.temporal_scale)
    segment = np.concatenate([np.repeat(mask, b, axis=0), latents], axis=1)
    return np.concatenate([np.repeat(image_condition, b, axis=0), segment], axis=2)


def _empty_cache(pipe: Pipeline, program: str) -> Any:
    """The reference cache, zeros on the devices, laid out as the reference pass takes it (it is overwritten)."""
    bundle = pipe.bundle
    spec = pipe.manifest.programs[program].inputs["ref_cache"]
    names = runner.signature_of(bundle, program)
    placed = dict(zip(names, bundle.call_shardings(program), strict=True))["ref_cache"]
    return jax.jit(lambda: jnp.zeros(spec.shape, jnp.dtype(spec.dtype)), out_shardings=placed)()
