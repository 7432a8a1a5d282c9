"""The image conditioning of image-to-video kinds, computed on the host around the bundle's programs.

Numpy only: the programs are reached through `call(name)` (a function taking the program's inputs in
call order, runtime/signatures.py, and returning its outputs) and `host(x)` (an output as a numpy
array), so the runtime's pipeline and a client of the TensorFlow SavedModel (tools/tf_generate.py)
build exactly the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import images
from .kinds import Kind
from .manifest import Geometry

Call = Callable[[str], Callable[..., Any]]
Host = Callable[[Any], np.ndarray]


def encode_images(kind: Kind, g: Geometry, image_processor: dict[str, Any] | None, first: Any, last: Any | None,
                  call: Call, host: Host, chunk_frames: int) -> dict[str, np.ndarray]:
    """The denoise programs' image inputs (the names of kind.denoise_extras), float32, from PIL images:
    `image_embeds` (B x images, tokens, D) from CLIP's penultimate layer; `condition` (VAE latents of the
    image(s), with the frame mask in front for "concat" kinds); `mask` (1, 1, T, h, w) for "first_frame"
    kinds. `chunk_frames` is the pixel frames per `vae_encode_next` call."""
    b = g.batch
    out: dict[str, np.ndarray] = {}
    if kind.image_encoder:  # CLIP on both images at once; FLF2V's DiT sees their tokens side by side
        pixels = images.clip_pixels([first, *([last] if last is not None else [])], image_processor)
        (hidden,) = _outputs(call("image_encoder")(pixels))
        out["image_embeds"] = np.tile(host(hidden).astype(np.float32), (b, 1, 1))  # diffusers: .repeat(b, 1, 1)
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
    """A "first_frame" kind (TI2V) without an image: zero condition, all-ones mask (every token gets the
    step's timestep, nothing is replaced); other kinds take nothing extra without an image."""
    if kind.conditioning != "first_frame":
        return {}
    return {"condition": np.zeros(shapes["condition"], np.float32), "mask": np.ones(shapes["mask"], np.float32)}


def restore_first_frame(kind: Kind, extras: dict[str, np.ndarray], latents: np.ndarray) -> np.ndarray:
    """After the loop, a "first_frame" kind's image frame is the image's latent again (diffusers' TI2V)."""
    if kind.conditioning != "first_frame":
        return latents
    cond, mask = extras["condition"], extras["mask"]
    return (1.0 - mask) * cond + mask * latents


def _outputs(result: Any) -> list[Any]:
    """A program's outputs as a flat list in call order (the runtime returns nested tuples)."""
    if isinstance(result, (list, tuple)):
        return [leaf for r in result for leaf in _outputs(r)]
    return [result]
