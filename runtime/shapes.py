"""Which of a bundle's shapes a run makes: pure functions of the manifest (and the kind), no programs, no devices.

A bundle makes one or more shapes (width x height x frames, with VACE's count of reference images; the manifest's
first is the default): one copy of the weights, programs per shape. A size ("WxH" or (width, height)), a frame count,
the latents given, a video's frame count or the conditioning's tensors pick one; what is not given is the default
shape's. A shape the bundle lacks is a UserError naming those it has."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import manifest as mf
from .errors import UserError
from .kinds import Kind

Size = str | tuple[int, int] | None  # "WxH" or (width, height); None: the default shape's


def parse_size(size: Size) -> tuple[int, int]:
    """"WxH" (or "W*H", Wan's spelling) or (width, height) -> (width, height); UserError if it is neither."""
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, (int, np.integer)) for v in size):
        return int(size[0]), int(size[1])
    if isinstance(size, str):
        parts = size.strip().lower().replace("*", "x").split("x")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            return int(parts[0]), int(parts[1])
    raise UserError(f"size {size!r} is not WIDTHxHEIGHT (e.g. 1280x720)")


def shape(m: mf.Manifest, size: Size = None, frames: int | None = None,
          reference_images: int | None = None) -> mf.Geometry:
    """The bundle's shape of this size, frame count and count of reference images (VACE); what is None is the
    default shape's (or, for a size whose shapes lack the default's frames, that size's first). UserError naming the
    bundle's shapes (or reference image counts) if it has none such."""
    d = m.geometry
    width, height = parse_size(size) if size is not None else (d.width, d.height)
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, (int, np.integer))):
        raise UserError(f"frames must be an integer, got {frames!r}")
    refs = d.reference_images if reference_images is None else reference_images
    g = m.find_shape(width, height, d.frames if frames is None else int(frames), refs)
    if g is None and frames is None:
        g = m.find_shape(width, height, None, refs)
    if g is None:
        counts = m.reference_counts
        if refs not in counts and m.find_shape(width, height, frames) is not None:
            raise UserError(f"{refs} reference image{'s' * (refs != 1)}: this bundle serves "
                            f"{' or '.join(map(str, counts))} (export with --reference-images for others)")
        asked = f"{width}x{height} x {frames if frames is not None else d.frames} frames"
        raise UserError(f"this bundle makes no {asked} video: its shapes are {m.shapes_text()} "
                        "(export one with --resolution/--frames for others)")
    return g


def for_videos(m: mf.Manifest, kind: Kind, size: Size = None, frames: int | None = None,
               video: Sequence[Any] | None = None, reference_images: Sequence[Any] | None = None) -> mf.Geometry:
    """The shape a run with these video inputs makes: `video`'s frame count is the shape's frames (it must agree with
    `frames`), and a VACE bundle's shape has as many reference image frames as `reference_images`. UserError naming
    what the bundle makes otherwise."""
    if video is not None and kind.video in ("prefix", "context"):  # the video's frames start the shape's (AnyFlow)
        return shape(m, size, frames)
    if video is not None:
        n = len(video)
        if frames is not None and frames != n:
            raise UserError(f"the video has {n} frames but frames={frames} was asked: give a video of {frames} "
                            "frames, or leave frames out")
        counts = [g.frames for g in m.shapes]
        if n not in counts:
            made = " or ".join(map(str, sorted(set(counts))))
            raise UserError(f"the video has {n} frames; this bundle makes {made} (its shapes: "
                            f"{m.shapes_text()}): trim or pad the video, or export with "
                            "--frames for its count (4k+1)")
        frames = n
    refs = len(reference_images or []) if kind.vace else None
    return shape(m, size, frames, refs)


def of_latents(m: mf.Manifest, latent_shape: tuple[int, ...], video: bool = False) -> mf.Geometry:
    """The bundle's shape whose denoised latents (`video`: the video's latents the VAE decodes, VACE's reference
    frames dropped) have this shape; UserError naming the shapes if none."""
    for g in m.shapes:
        if tuple(latent_shape) == (g.video_latent_shape if video else g.latent_shape):
            return g
    want = ", ".join(f"{list(g.video_latent_shape if video else g.latent_shape)} ({g.describe()})" for g in m.shapes)
    raise UserError(f"latents have shape {list(latent_shape)}, this bundle needs one of {want}")


def of_denoising(m: mf.Manifest, embeds: dict[str, Any], latents: Any, size: Size = None,
                 frames: int | None = None) -> mf.Geometry:
    """The shape a denoising run makes: that of `latents` (which must agree with `size`/`frames` where given); else
    `size` x `frames`; else, for image conditioning in `embeds`, the shape it was encoded for; else the default
    shape."""
    if latents is not None:
        g = of_latents(m, np.shape(latents))
        if (size is not None or frames is not None) and shape(m, size, frames, g.reference_images) != g:
            raise UserError(f"latents of shape {list(np.shape(latents))} are for {g.describe()}, "
                            f"not the size/frames asked for")
        return g
    by_tensor = {"control": "latent_shape", "video_latents": "latent_shape"}  # (B, C, frames, h, w) says the shape
    for key, attr in by_tensor.items():
        if isinstance(embeds, dict) and key in embeds:
            found = [g for g in m.shapes if getattr(g, attr)[2:] == tuple(np.shape(embeds[key]))[2:]
                     and (size is None or shape(m, size, frames, g.reference_images).key == g.key)]
            if len(found) == 1 or (found and size is not None):
                return found[0]
            if len(found) > 1:
                fits = ", ".join(g.describe() for g in found)
                raise UserError(f"{key} fits several of this bundle's shapes ({fits}): give size and frames")
    if size is not None or frames is not None or len(m.shapes) == 1:
        return shape(m, size, frames)
    condition = embeds.get("condition") if isinstance(embeds, dict) else None
    if condition is not None:  # (B, C, T or 1, h, w): "first_frame" kinds' mask says T
        t = np.shape(embeds["mask"])[2] if "mask" in embeds else np.shape(condition)[2]
        h, w = np.shape(condition)[-2:]
        for g in m.shapes:
            if (g.latent_frames, g.latent_height, g.latent_width) == (t, h, w):
                return g
    return m.geometry


def of_decoding(m: mf.Manifest, latent_shape: tuple[int, ...]) -> mf.Geometry:
    """The bundle shape whose VAE decoder decodes video latents of `latent_shape` (B, z, T, h, w): the one they are the
    video latents of, or (diffusion forcing's videos of any length: the decoder's programs take one latent frame at a
    time) one of their size, if it decodes more than one frame where T does. UserError otherwise."""
    latent_shape = tuple(latent_shape)
    for g in m.shapes:
        if latent_shape == g.video_latent_shape:
            return g
    if len(latent_shape) == 5:
        for g in m.shapes:
            b, z, _, h, w = g.video_latent_shape
            if (b, z, h, w) == (latent_shape[0], latent_shape[1], latent_shape[3], latent_shape[4]) and \
                    (latent_shape[2] == 1 or m.program_for("vae_decode_next", g) in m.programs):
                return g
    return of_latents(m, latent_shape, video=True)  # raises, naming the shapes
