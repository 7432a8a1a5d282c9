"""The conditioning of image- and video-to-video kinds, computed on the host around the bundle's programs: the
image latents of I2V, VACE's control (video, mask, reference images) and video-to-video's noised latents.

Numpy only: the programs are reached through `call(name)` (a function taking the program's inputs in
call order, runtime/signatures.py, and returning its outputs) and `host(x)` (an output as a numpy
array), so the runtime's pipeline and a client of the TensorFlow SavedModel (tools/tf_generate.py)
build exactly the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import images, kinds, video_input
from . import manifest as mf
from .errors import UserError
from .kinds import Kind
from .manifest import Geometry

Call = Callable[[str], Callable[..., Any]]
Host = Callable[[Any], np.ndarray]


def encode_images(kind: Kind, g: Geometry, image_processor: dict[str, Any] | None, first: Any, last: Any | None,
                  call: Call, host: Host, chunk_frames: int) -> dict[str, np.ndarray]:
    """The denoise programs' image inputs (the names of kind.denoise_extras), float32, from PIL images:
    `image_embeds` (B x images, tokens, D) from CLIP's penultimate layer; `condition` (VAE latents of the
    image(s), with the frame mask in front for "concat" kinds); `mask` (1, 1, T, h, w) for "first_frame"
    kinds; for Animate, `reference_latents` (B, s + z, 1, h, w) (the character image letterboxed, its latents after
    a mask of ones: the first latent frame of every segment's `condition`, runtime/animate.py). `chunk_frames` is
    the pixel frames per `vae_encode_next` call."""
    b = g.batch
    out: dict[str, np.ndarray] = {}
    if kind.image_encoder:  # CLIP on both images at once; FLF2V's DiT sees their tokens side by side
        pixels = images.clip_pixels([first, *([last] if last is not None else [])], image_processor)
        (hidden,) = _outputs(call("image_encoder")(pixels))
        out["image_embeds"] = np.tile(host(hidden).astype(np.float32), (b, 1, 1))  # diffusers: .repeat(b, 1, 1)
    if kind.animate:  # the character image, letterboxed, as one latent frame before the segment's, mask all ones
        latents = encode_video(images.letterbox_pixels(first, g.width, g.height)[:, None], call, host, chunk_frames)
        ones = np.ones((1, g.temporal_scale, *latents.shape[2:]), np.float32)
        out["reference_latents"] = np.repeat(np.concatenate([ones, latents], axis=1), b, axis=0)
        return out
    frames = [images.vae_pixels(first, g.width, g.height)]
    if last is not None:
        frames.append(images.vae_pixels(last, g.width, g.height))
    latents = vae_encode(kind, g, frames, call, host, chunk_frames)  # (1, z, T or 1, h, w), normalised
    if kind.conditioning == "first_frame":
        mask = np.ones((1, 1, g.latent_frames, g.latent_height, g.latent_width), np.float32)
        mask[:, :, 0] = 0.0
        out["condition"], out["mask"] = np.repeat(latents, b, axis=0), mask
    else:
        out["condition"] = np.repeat(np.concatenate([frame_mask(g, last is not None), latents], axis=1), b, axis=0)
    return out


def vae_encode(kind: Kind, g: Geometry, frames: list[np.ndarray], call: Call, host: Host,
               chunk_frames: int) -> np.ndarray:
    """VAE latents of the conditioning: the image alone ("image"), or the video [image, zeros..., last
    image or zero] chunk by chunk ("video"), as the I2V pipelines build it."""
    latents, *caches = _outputs(call("vae_encode_first")(frames[0][None, :, None]))
    chunks = [latents]
    if kind.vae_encode == "video" and g.latent_frames > 1:
        nxt = call("vae_encode_next")
        for t in range(1, g.latent_frames):
            chunk = np.zeros((1, 3, chunk_frames, g.height, g.width), np.float32)
            if t == g.latent_frames - 1 and len(frames) > 1:
                chunk[0, :, -1] = frames[1]  # the video's last frame
            latents, *caches = _outputs(nxt(chunk, *caches))
            chunks.append(latents)
    return np.concatenate([host(c).astype(np.float32) for c in chunks], axis=2)


def encode_video(pixels: np.ndarray, call: Call, host: Host, chunk_frames: int) -> np.ndarray:
    """VAE latents of a (3, F, H, W) video in [-1, 1], normalised, (1, z, T, h, w): the first frame alone, then chunks
    of `chunk_frames` frames with the causal caches carried (diffusers' AutoencoderKLWan.encode, distribution mode)."""
    frames = pixels.shape[1]
    latents, *caches = _outputs(call("vae_encode_first")(np.ascontiguousarray(pixels[None, :, :1], np.float32)))
    chunks = [latents]
    if frames > 1:
        nxt = call("vae_encode_next")
        for start in range(1, frames, chunk_frames):
            piece = np.ascontiguousarray(pixels[None, :, start:start + chunk_frames], np.float32)
            latents, *caches = _outputs(nxt(piece, *caches))
            chunks.append(latents)
    return np.concatenate([host(c).astype(np.float32) for c in chunks], axis=2)


def vace_control(g: Geometry, video: np.ndarray | None, mask: np.ndarray | None, references: list[np.ndarray],
                 call: Call, host: Host, chunk_frames: int) -> np.ndarray:
    """WanVACEPipeline's conditioning latents, float32 (B, 2z + s^2, R + T, h, w), from `video` (F, 3, H, W) in
    [-1, 1] (None: zeros), `mask` (F, C, H, W) in [0, 1] (None: ones) and the R reference images (3, H, W):

    - the mask binarized at 0.5; the video's inactive part (video x (1 - mask)) and reactive part (video x mask)
      VAE-encoded, normalised, side by side on the channel axis;
    - each reference image VAE-encoded as a one-frame video, beside zeros, put before the frames (each one before
      the ones already there: the last reference image comes first), as `prepare_video_latents` does;
    - the mask's first channel folded s x s onto the latent grid (s = spatial scale), resampled to T frames
      ("nearest-exact"), with R zero frames before, as `prepare_masks` does."""
    frames, s = g.frames, g.spatial_scale
    if video is None:
        video = np.zeros((frames, 3, g.height, g.width), np.float32)
    if mask is None:
        mask = np.ones_like(video)
    binary = np.where(mask > 0.5, 1.0, 0.0).astype(np.float32)
    parts = [encode_video((video * (1 - binary)).transpose(1, 0, 2, 3), call, host, chunk_frames),
             encode_video((video * binary).transpose(1, 0, 2, 3), call, host, chunk_frames)]
    latents = np.concatenate(parts, axis=1)
    for ref in references:
        ref_latent = encode_video(ref[:, None], call, host, chunk_frames)
        latents = np.concatenate([np.concatenate([ref_latent, np.zeros_like(ref_latent)], axis=1), latents], axis=2)
    m = mask[:, 0].reshape(frames, g.latent_height, s, g.latent_width, s).transpose(2, 4, 0, 1, 3)
    m = m.reshape(s * s, frames, g.latent_height, g.latent_width)
    index = np.minimum(np.floor((np.arange(g.latent_frames) + 0.5) * (frames / g.latent_frames)).astype(int),
                       frames - 1)  # "nearest-exact" on the frame axis
    m = m[:, index]
    m = np.concatenate([np.zeros((s * s, len(references), *m.shape[2:]), np.float32), m], axis=1)
    control = np.concatenate([latents[0], m], axis=0)[None]
    return np.repeat(control, g.batch, axis=0).astype(np.float32)


def encode_videos(kind: Kind, g: Geometry, video: list[Any] | None, mask: list[Any] | None, references: list[Any],
                  call: Call, host: Host, chunk_frames: int) -> dict[str, np.ndarray]:
    """The denoise inputs of a video (PIL frames, already checked against shape `g`): a VACE kind's `control`
    (`vace_control`, from the video, mask and reference images, each preprocessed as WanVACEPipeline does); for a kind
    whose programs take the video's latents as `condition` (Lucy Edit: beside the noise at every step), those;
    else video-to-video's `video_latents`. Both are (B, z, T, h, w): the video's VAE latents, as LucyEditPipeline and
    WanVideoToVideoPipeline encode them (distribution mode, normalised); video-to-video's are noised by the denoise
    loop at the step its strength picks."""
    pixels = None if video is None else video_input.video_pixels(video, g.width, g.height)
    if kind.vace:
        masks = None if mask is None else video_input.mask_pixels(mask, g.width, g.height)
        refs = [video_input.reference_pixels(r, g.width, g.height) for r in references]
        return {"control": vace_control(g, pixels, masks, refs, call, host, chunk_frames)}
    latents = encode_video(pixels.transpose(1, 0, 2, 3), call, host, chunk_frames)
    if kind.video == "prefix":  # AnyFlow: the video's latent frames first, pinned (mask 0), the rest generated
        b, (_, z, t, h, w) = g.batch, latents.shape
        condition = np.zeros((b, z, g.latent_frames, h, w), np.float32)
        condition[:, :, :t] = latents
        mask = np.ones((1, 1, g.latent_frames, h, w), np.float32)
        mask[:, :, :t] = 0.0
        return {"condition": condition, "mask": mask}
    key = "condition" if kind.channel_condition == "latents" else "video_latents"
    return {key: np.repeat(latents, g.batch, axis=0)}


def control_scale(scale: Any, layers: int) -> np.ndarray:
    """VACE's `conditioning_scale` as the programs take it: float32 (layers,), one per VACE layer, from a number or
    a list of one per layer (diffusers' `conditioning_scale`); UserError otherwise."""
    values = [scale] * layers if isinstance(scale, (int, float, np.floating, np.integer)) and \
        not isinstance(scale, bool) else scale
    try:
        out = np.asarray(values, np.float64)
    except (TypeError, ValueError):
        out = np.asarray([np.nan])
    if out.ndim != 1 or len(out) != layers or not np.isfinite(out).all():
        raise UserError(f"conditioning_scale must be a number or a list of {layers} numbers (one per VACE layer of "
                        f"this model), got {scale!r}")
    return out.astype(np.float32)


def noised(latents: np.ndarray, noise: np.ndarray, sigma: float) -> np.ndarray:
    """Video-to-video's start: (1 - sigma) x latents + sigma x noise, what diffusers' flow schedulers' `add_noise`
    (UniPC, DPM-Solver) and `scale_noise` (Euler) give at the first step run, in float32."""
    s = np.float32(sigma)
    return (s * noise.astype(np.float32) + (np.float32(1) - s) * latents.astype(np.float32)).astype(np.float32)


def frame_mask(g: Geometry, has_last: bool) -> np.ndarray:
    """diffusers' mask_lat_size: 1 on the given frames (first, and last for FLF2V), the first repeated
    x temporal_scale, folded into (1, temporal_scale, T, h, w)."""
    s = g.temporal_scale
    m = np.zeros(g.frames, np.float32)
    m[0] = 1.0
    if has_last:
        m[-1] = 1.0
    m = np.concatenate([np.repeat(m[:1], s), m[1:]]).reshape(g.latent_frames, s).T  # (s, T)
    return np.broadcast_to(m[None, :, :, None, None],
                           (1, s, g.latent_frames, g.latent_height, g.latent_width)).astype(np.float32)


def text_mode(kind: Kind, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """A "first_frame" kind (TI2V) without an image, a "flowmap" one (AnyFlow) without a video: zero condition, all-ones mask (every token gets the
    step's timestep, nothing is replaced); other kinds take nothing extra without an image."""
    if kind.conditioning not in ("first_frame", "flowmap"):
        return {}
    return {"condition": np.zeros(shapes["condition"], np.float32), "mask": np.ones(shapes["mask"], np.float32)}


def after_loop(kind: Kind, extras: dict[str, np.ndarray], latents: np.ndarray, g: Geometry) -> np.ndarray:
    """The denoised latents as the VAE decodes them: a "first_frame" kind's image frame is the image's latent again
    (diffusers' TI2V); the reference images' frames (VACE, Animate) are dropped."""
    if kind.conditioning in ("first_frame", "flowmap"):  # (AnyFlow: the given video's latent frames)
        cond, mask = extras["condition"], extras["mask"]
        return (1.0 - mask) * cond + mask * latents
    return latents[:, :, g.reference_images:]  # VACE's reference images, Animate's reference image


def _outputs(result: Any) -> list[Any]:
    """A program's outputs as a flat list in call order (the runtime returns nested tuples)."""
    if isinstance(result, (list, tuple)):
        return [leaf for r in result for leaf in _outputs(r)]
    return [result]


# -- the checks of a run's conditioning, before any program runs ------------------------------------------------------
def load_videos(kind: Kind, video: Any, mask: Any, reference_images: Any) -> dict[str, Any] | None:
    """A run's video inputs as PIL frames, or None where it has none (VACE kinds always have some: no video is a zero
    video). Unreadable inputs fail here, before any program runs."""
    if video is None and not kind.vace:
        return None
    refs = list(reference_images or [])
    if reference_images is not None and not isinstance(reference_images, (list, tuple)):
        raise UserError("reference_images must be a list of images (PIL images, paths or uint8 arrays)")
    return {"video": None if video is None else video_input.load_frames(video, "video"),
            "mask": None if mask is None else video_input.load_mask(mask, "mask"),
            "references": [images.load_image(r, f"reference image {i + 1}") for i, r in enumerate(refs)]}


def check_videos(kind: Kind, m: mf.Manifest, g: Geometry, media: dict[str, Any]) -> None:
    """The loaded video inputs against shape `g`: a video of the shape's frames (a flow-map kind's: the first 4k+1
    frames to continue, fewer than it makes), a mask of one frame per video frame and of the video's size."""
    video, mask = media["video"], media["mask"]
    if video is not None and kind.video == "prefix":
        n, scale = len(video), g.temporal_scale
        if n % scale != 1 or n >= g.frames:
            raise UserError(f"the video has {n} frames: give the first frames to continue, 4k+1 of them (1, 5, "
                            f"9, ...) and fewer than the {g.frames} this run makes at {g.size}")
        return
    if video is not None and len(video) != g.frames:
        raise UserError(f"the video has {len(video)} frames; this bundle makes {g.frames} at {g.size}: its shapes "
                        f"are {m.shapes_text()}")
    if mask is not None:
        want = len(video) if video is not None else g.frames
        if len(mask) != want:
            raise UserError(f"the mask has {len(mask)} frame{'s' * (len(mask) != 1)}, the "
                            f"{'video' if video else 'shape'} {want}: give one mask frame per video frame")
        if video is not None and mask[0].size != video[0].size:
            raise UserError(f"the mask is {mask[0].width}x{mask[0].height}, the video "
                            f"{video[0].width}x{video[0].height}: give a mask of the video's size")


def step_inputs(kind: Kind, m: mf.Manifest, embeds: dict[str, Any], g: Geometry, conditioning_scale: Any,
                precomputes_kv: bool) -> dict[str, np.ndarray]:
    """The conditioning inputs of the denoise (and cross_kv) programs of shape `g`, by name (kind.denoise_extras),
    from `embeds`, checked (shape, finite): text mode of a "first_frame" kind without one; a VACE kind's
    `control_scale` from `conditioning_scale`. UserError naming what is missing or wrong."""
    specs = dict(m.programs[m.program_for(kinds.denoise_program(0), g)].inputs)
    if precomputes_kv:
        specs.update(m.programs[kinds.cross_kv_program(0)].inputs)
    if kind.conditioning in ("first_frame", "flowmap") and "condition" not in embeds:  # as text-to-video
        embeds = {**embeds, **text_mode(kind, {k: v.shape for k, v in specs.items()})}
    if kind.vace:
        scale = 1.0 if conditioning_scale is None else conditioning_scale
        embeds = {**embeds, "control_scale": control_scale(scale, specs["control_scale"].shape[0])}
    elif conditioning_scale is not None:
        raise UserError(f"conditioning_scale is for VACE models; this bundle is {kind.title}")
    out = {}
    for name in kind.denoise_extras:
        if name in kinds.STEP_INPUTS:  # the loop's, per step
            continue
        if name not in embeds:
            what = "video inputs" if kind.vace else "video (--video / video=...)" \
                if kind.video == "required" else "image (--image / image=...)"
            raise UserError(f"this bundle is {kind.title}: the embeddings have no {name!r}; encode with the {what}")
        value = np.asarray(embeds[name], np.float32)
        if value.shape != specs[name].shape:
            also = f" at {g.size} x {g.frames} frames (encode with the same size and frames)" \
                if len(m.shapes) > 1 else ""
            raise UserError(f"{name} has shape {list(value.shape)}, this bundle needs {list(specs[name].shape)}"
                            + also)
        if not np.isfinite(value).all():
            raise UserError(f"{name} contains NaN or inf")
        out[name] = value
    return out
