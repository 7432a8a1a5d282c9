"""Wan-Animate at any length: the segment loop around the one-segment pipeline, as diffusers' WanAnimatePipeline
runs it.

A character image is moved by a pose video and a face video ("animate"), or put into a video in place of someone
("replace", with that video's background and a mask of the person: white where the character goes). A bundle's shape
is one segment of L frames (`--frames`, 77 as diffusers has it); a video of n frames (the pose video's) is made in
segments of L frames, each starting from the last `prev` frames the one before made (prev_segment_frames, 1 or 5):

    segment i covers the input frames [i (L - prev), i (L - prev) + L); the inputs are padded to whole segments by
    reflection (frames 1 2 3 2 1 2 ...); each segment has its own noise (`latents`, or from the seed) and the sampler
    starts afresh; the frames of segment i > 0 after its first prev are kept; the video is cut to n frames.

Per request, once: the prompt's embeddings, the character image's CLIP embeddings and latents, and with guidance the
motion vectors of an all-black face (the unconditional half's). Per segment: the pose window's and the conditioning
video's VAE latents (zeros, or the background, after the previous segment's last frames), the face window's motion
vectors (the face_motion program), the denoising steps, the decode.

Inputs are the preprocessed videos diffusers takes (rendered poses, face crops; see the README for the tools that make
them from footage), as paths, PIL frames or arrays (runtime/video_input.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from . import steps as runner
from . import video_input
from .distributed import fetch
from .errors import UserError
from .noise import seed_noise, segment_noise  # noqa: F401  (segment_noise: also this module's public name)
from .segment import denoise as denoise_segment

Pipeline = Any  # the front (runtime/pipeline.py), which imports this loop: the loop calls its public methods

MODES = ("animate", "replace")
PREV_FRAMES = (1, 5)  # diffusers' prev_segment_conditioning_frames


@dataclass(frozen=True)
class Segments:
    """How a video of `frames` frames splits into segments of `length` frames overlapping by `prev`."""

    frames: int
    length: int
    prev: int

    @property
    def stride(self) -> int:
        return self.length - self.prev

    @property
    def count(self) -> int:
        return -(-(self.frames - self.prev) // self.stride)

    @property
    def padded(self) -> int:
        """The frames the inputs are padded to: whole segments."""
        return self.prev + self.count * self.stride

    def window(self, i: int) -> slice:
        return slice(i * self.stride, i * self.stride + self.length)


def segments(frames: int, length: int, prev: Any) -> Segments:
    """The segments of a pose video of `frames` frames on a bundle shape of `length` frames; UserError for a
    prev_segment_frames diffusers does not take, a shape too short for it, or a pose video too short."""
    if isinstance(prev, bool) or not isinstance(prev, (int, np.integer)) or prev not in PREV_FRAMES:
        raise UserError(f"prev_segment_frames must be 1 or 5 (the frames each segment takes from the one before), "
                        f"got {prev!r}")
    if length < 2 * prev + 1:
        raise UserError(f"prev_segment_frames {prev} needs segments of at least {2 * prev + 1} frames, and this "
                        f"shape's are {length}: use prev_segment_frames 1, or a shape of more frames")
    if frames < prev + 1:
        raise UserError(f"the pose video has {frames} frame{'s' * (frames != 1)}: it needs at least "
                        f"prev_segment_frames + 1 = {prev + 1}")
    return Segments(frames, length, int(prev))


def reflect(frames: list[Any], n: int) -> list[Any]:
    """`frames` padded (or cut) to n by reflection without repeating the ends, as diffusers' pad_video_frames:
    [1, 2, 3, 4, 5] -> [1, 2, 3, 4, 5, 4, 3, 2, 1, 2]."""
    if len(frames) >= n or len(frames) == 1:
        return (frames * n)[:n]
    out, i, step = [], 0, 1
    while len(out) < n:
        out.append(frames[i])
        i += step
        if i in (0, len(frames) - 1):
            step = -step
    return out


def mask_pixels(frames: list[Image.Image], width: int, height: int) -> np.ndarray:
    """float32 (F, H, W) in [0, 1]: a replace mask as WanAnimatePipeline's mask processor makes it (Lanczos resize,
    then greyscale, / 255; not binarized)."""
    return np.stack([np.asarray(f.resize((width, height), resample=Image.Resampling.LANCZOS).convert("L"),
                                np.float32) / np.float32(255.0) for f in frames])


def frame_mask(keep: np.ndarray | None, length: int, latent_frames: int, h: int, w: int, ones: int,
               temporal_scale: int) -> np.ndarray:
    """diffusers' get_i2v_mask: float32 (1, s, T, h, w) from a per-frame mask (length, h, w) (None: zeros), its first
    `ones` frames set to 1 (the frames taken from the segment before), the first frame repeated s times, folded."""
    m = np.zeros((length, h, w), np.float32) if keep is None else keep.astype(np.float32).copy()
    m[:ones] = 1.0
    m = np.concatenate([np.repeat(m[:1], temporal_scale, axis=0), m[1:]])
    return np.ascontiguousarray(m.reshape(latent_frames, temporal_scale, h, w).transpose(1, 0, 2, 3)[None])


class InputError(UserError):
    """A Wan-Animate input missing, extra or of the wrong length; `field` names it (the API's field, the Python
    keyword)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_counts(mode: Any, pose: int | None, face: int | None, background: int | None, mask: int | None) -> None:
    """The inputs a mode takes, by their frame counts (None: not given); InputError naming the first problem."""
    if mode not in MODES:
        raise InputError(f"mode must be 'animate' or 'replace', got {mode!r}", "mode")
    for name, n in (("pose_video", pose), ("face_video", face)):
        if n is None:
            raise InputError(f"Wan-Animate needs a pose video and a face video: give {name} ({_flag(name)})", name)
    if mode == "animate":
        for name, n in (("background_video", background), ("mask_video", mask)):
            if n is not None:
                raise InputError(f"{name} is for mode 'replace': leave it out, or use mode 'replace'", name)
    else:
        for name, n in (("background_video", background), ("mask_video", mask)):
            if n is None:
                raise InputError(f"mode 'replace' needs a background video and a mask video: give {name} "
                                 f"({_flag(name)})", name)
    for name, n in (("face_video", face), ("background_video", background), ("mask_video", mask)):
        if n is not None and n != pose:
            raise InputError(f"{name} has {n} frames and pose_video {pose}: give one {name.split('_')[0]} frame per "
                             "pose frame", name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class Inputs:
    """The videos of a Wan-Animate run, as PIL frames."""

    pose: list[Image.Image]
    face: list[Image.Image]
    background: list[Image.Image] | None
    mask: list[Image.Image] | None


def load_inputs(pose_video: Any, face_video: Any, mode: Any, background_video: Any, mask_video: Any) -> Inputs:
    """The four videos as PIL frames, checked against each other and the mode (InputError, one line, before any
    program runs)."""
    given = {"pose_video": pose_video, "face_video": face_video, "background_video": background_video,
             "mask_video": mask_video}
    check_counts(mode, *[None if v is None else 0 for v in given.values()])  # what is missing or extra, first
    frames = {name: None if v is None else
              (video_input.load_mask if name == "mask_video" else video_input.load_frames)(v, name.replace("_", " "))
              for name, v in given.items()}
    check_counts(mode, *[None if f is None else len(f) for f in frames.values()])
    return Inputs(*frames.values())


def generate(pipe: Pipeline, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
             image: Any = None, pose_video: Any = None, face_video: Any = None, mode: str = "animate",
             background_video: Any = None, mask_video: Any = None, prev_segment_frames: int = 1, seed: int = 0,
             steps: int | None = None, guidance: float | None = None, flow_shift: float | None = None,
             guidance_2: float | None = None, sampler: str | None = None, sigmas: Sequence[float] | None = None,
             latents: Any = None, progress: bool = True, magcache: Any = None, size: Any = None,
             frames: int | None = None, low_memory: bool = False,
             on_step: Callable[[int, int], None] | None = None,
             on_preview: Callable[[np.ndarray], None] | None = None, decoder: str = "full",
             on_frames: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """frames (B, n, H, W, 3) float32 in [0, 1], n the pose video's frame count (see the module docstring).
    `size` and `frames` pick the bundle shape (the segment); `on_step(done, total)` follows every step of every
    segment, `on_preview` each step's estimate of the segment's middle frame (Pipeline.denoise), `on_frames(frames)`
    each segment's frames that the video keeps, (B, f, H, W, 3), as soon as it is decoded. The rest as
    Pipeline.generate."""
    if image is None:
        raise UserError("Wan-Animate needs the character's image (image=..., --image)")
    pipe.decoder_programs(decoder)  # a decoder the bundle lacks fails before any work
    inputs = load_inputs(pose_video, face_video, mode, background_video, mask_video)
    g = pipe.shape(size, frames)
    seg = segments(len(inputs.pose), g.frames, prev_segment_frames)
    s = pipe.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
    noise = segment_noise(latents, seg.count, g.latent_shape)
    pose, face = reflect(inputs.pose, seg.padded), reflect(inputs.face, seg.padded)
    background = reflect(inputs.background, seg.padded) if inputs.background is not None else None
    keep = None
    if inputs.mask is not None:  # where the character goes is generated: the conditioning keeps 1 - mask
        step = g.spatial_scale  # nearest-neighbour onto the latent grid
        keep = 1.0 - mask_pixels(reflect(inputs.mask, seg.padded), g.width, g.height)[:, ::step, ::step]

    pipe.start_loading(s, g, image=True, magcache=magcache, prompt=prompt, negative_prompt=negative_prompt)
    run = pipe.steps_run({}, s)
    total = run * seg.count
    bar = runner.progress_bar(total, progress, "animating")
    try:
        embeds = pipe.encode(prompt, negative_prompt, image, size=g.size, frames=g.frames)
        if low_memory:
            pipe.unload_before("denoise")
        face_call = pipe.call("face_motion", g)
        side = pipe.manifest.programs[pipe.manifest.program_for("face_motion", g)].inputs["face"].shape[-1]

        def motion_of(frames_: list[Image.Image] | None) -> np.ndarray:
            """The face_motion program's vectors (1, T, tokens, dim) of face frames (None: an all-black face)."""
            if frames_ is None:
                pixels = np.full((1, 3, g.frames, side, side), -1.0, np.float32)
            else:
                pixels = video_input.video_pixels(frames_, side, side).transpose(1, 0, 2, 3)[None]
            return fetch(face_call(np.ascontiguousarray(pixels))).astype(np.float32)

        uncond = s.guidance > 1.0 or magcache is not None  # whether any step runs the unconditional half
        black = motion_of(None) if uncond else None
        b = g.batch
        carried: np.ndarray | None = None  # (B, prev, H, W, 3) in [0, 1]: the last frames of the segment before
        out: list[np.ndarray] = []
        for i in range(seg.count):
            window = seg.window(i)
            pose_latents = pipe.encode_video(video_input.video_pixels(pose[window], g.width, g.height), g)
            motion = motion_of(face[window])
            motions = np.stack([np.repeat(motion, b, axis=0),
                                np.repeat(black if black is not None else np.zeros_like(motion), b, axis=0)])
            if background is not None:
                cond_video = video_input.video_pixels(background[window], g.width, g.height)  # (L, 3, H, W)
            else:
                cond_video = np.zeros((g.frames, 3, g.height, g.width), np.float32)
            conds = []
            for k in range(b):  # the frames carried differ per video of a batch
                video = cond_video.copy()
                if carried is not None:
                    video[: seg.prev] = 2.0 * carried[k].transpose(0, 3, 1, 2) - 1.0
                conds.append(pipe.encode_video(video, g))
            latents_ = np.concatenate(conds) if carried is not None else np.repeat(conds[0], b, axis=0)
            mask = frame_mask(None if keep is None else keep[window], g.frames, g.latent_frames, g.latent_height,
                              g.latent_width, seg.prev if i else 0, g.temporal_scale)
            segment = np.concatenate([np.repeat(mask, b, axis=0), latents_], axis=1)
            condition = np.concatenate([embeds["reference_latents"], segment], axis=2)
            x0 = noise[i] if noise[i] is not None else seed_noise(s.seed, i, g.latent_shape)
            done = i * run

            def step_done(j: int, done: int = done) -> None:
                bar.update(1)
                if on_step is not None:
                    on_step(done + j + 1, total)

            denoised = denoise_segment(pipe, {**embeds, "condition": condition,
                                       "pose": np.repeat(pose_latents, b, axis=0), "motion": motions}, s, x0,
                                       progress=False, on_step=step_done, magcache=magcache, size=g.size,
                                       frames=g.frames, on_preview=on_preview)
            frames_ = pipe.decode(denoised, decoder)  # (B, L, H, W, 3)
            carried = frames_[:, -seg.prev:]
            kept = frames_ if i == 0 else frames_[:, seg.prev:]
            kept = kept[:, : seg.frames - sum(o.shape[1] for o in out)]  # the video is cut to the pose's frames
            out.append(kept)
            if on_frames is not None and kept.shape[1]:
                on_frames(kept)
        return np.concatenate(out, axis=1)
    except BaseException:
        pipe.bundle.cancel_prefetch()
        raise
    finally:
        bar.close()
