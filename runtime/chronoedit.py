"""ChronoEdit: an image edited as a short video whose last frame is the edit, as diffusers' ChronoEditPipeline makes it.

ChronoEdit (nvidia/ChronoEdit-14B-Diffusers) is Wan2.1-I2V-14B (CLIP, the frame mask and the image's VAE latents beside
the noise: the "concat" conditioning) whose DiT, ChronoEditTransformer3DModel, differs from Wan's in its RoPE only:
exactly 2 latent frames sit at temporal positions 0 and rope_temporal_skip_len - 1 (7), so the DiT sees the input and
the edit as the two ends of a longer clip. Every exported shape's program has its frame count's positions baked in.

    plain edit            the edit shape: 2 latent frames (5 frames at Wan's 4x temporal scale), every step on it;
                          diffusers forces num_frames=5 without temporal reasoning, so another `frames` is refused
    temporal reasoning    K steps (`temporal_reasoning_steps`) over N frames (a shape of the bundle), then latent
                          frames [0, -1] of the scheduler's whole state (the sample, the last corrected sample, the
                          model outputs: diffusers' trim of UniPC's last_sample and model_outputs) and of the condition
                          (sliced from the N-frame condition, as diffusers does, not encoded again), and the remaining
                          steps of the same schedule on the edit shape's program; the 2 latent frames decode to 5

The edited image is the last frame. This loop runs the one-segment loop twice (runtime/segment.py: `denoise`'s
`stop_after` hands over the state, its `resume` goes on from it), on the one step runner; runtime/pipeline.py's
`generate` dispatches to it by the kind's loop (kinds.Kind.loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import manifest as mf
from . import segment
from .errors import UserError
from .files import atomic_path
from .shapes import Size
from .video import to_uint8

Pipeline = Any  # the front (runtime/pipeline.py), which imports this loop: the loop calls its public methods

if TYPE_CHECKING:
    from PIL import Image

    from .kinds import Kind
    from .magcache import MagCache

EDIT_LATENT_FRAMES = 2  # the input image's latent frame and the edit's: the RoPE's positions 0 and 7
TRIM = [0, -1]  # the latent frames temporal reasoning keeps (diffusers' latents[:, :, [0, -1]])
SAMPLER = "unipc"  # temporal reasoning trims UniPC's history (diffusers reads scheduler.model_outputs)
IMAGE_SUFFIXES = (".png",)  # `runtime generate --out` of an edit: the last frame as an image


def edit_shape(pipe: Pipeline, size: Size = None) -> mf.Geometry:
    """The bundle's edit shape at `size` (default: the default shape's): its 2-latent-frame one (5 frames). UserError
    naming the shapes where the bundle has none there."""
    g = pipe.shape(size, None)  # the size's default shape, or a one-line error naming the shapes
    for shape in pipe.manifest.shapes:
        if shape.size == g.size and shape.latent_frames == EDIT_LATENT_FRAMES:
            return shape
    frames = (EDIT_LATENT_FRAMES - 1) * g.temporal_scale + 1
    raise UserError(f"ChronoEdit edits on {frames} frames ({EDIT_LATENT_FRAMES} latent frames) and this bundle has no "
                    f"{g.size} x {frames} frames shape (its shapes: {pipe.manifest.shapes_text()}): export with "
                    f"--frames {frames} (and the frame counts to reason over, e.g. --frames {frames},29)")


def check_shapes(shapes: Sequence[mf.Geometry]) -> None:
    """An export's shapes (export/build.py): every run ends on the edit's 2 latent frames (a plain edit, and temporal
    reasoning's last steps), so --frames must hold their count; UserError naming it, before any tracing."""
    if shapes and not any(g.latent_frames == EDIT_LATENT_FRAMES for g in shapes):
        frames = (EDIT_LATENT_FRAMES - 1) * shapes[0].temporal_scale + 1
        given = ",".join(str(f) for f in dict.fromkeys(g.frames for g in shapes))
        raise UserError(f"ChronoEdit edits on {frames} frames ({EDIT_LATENT_FRAMES} latent frames), where every run "
                        f"ends: --frames {given} lacks {frames} (add it: --frames {frames},{given})")


def _steps(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise UserError(f"temporal_reasoning_steps must be an integer >= 0, got {k!r}")
    return int(k)


def reasoning_shapes(pipe: Pipeline, k: int, steps: int, sampler: str, size: Size,
                     frames: int | None, magcache: Any = None) -> tuple[mf.Geometry, mf.Geometry]:
    """(the N-frame shape the first `k` steps run on, the edit shape the rest run on) of a temporal reasoning run of
    `steps` steps; UserError in one line, before any work, for a run diffusers' pipeline cannot make: another sampler
    (diffusers trims UniPC's history, which FlowMatchEulerDiscreteScheduler lacks), k >= steps (nothing left to edit
    on 2 frames), a frame count the bundle was not exported with, MagCache (its residuals would be of the N-frame
    shape). `frames` None: the most frames the bundle has at that size."""
    if sampler != SAMPLER:
        raise UserError(f"temporal reasoning trims UniPC's history (diffusers' ChronoEditPipeline reads "
                        f"scheduler.model_outputs): it runs with sampler {SAMPLER}, not {sampler}")
    if k >= steps:
        raise UserError(f"temporal_reasoning_steps {k} must be fewer than the {steps} steps: the steps after them "
                        f"edit on {EDIT_LATENT_FRAMES} latent frames")
    if magcache is not None:
        raise UserError("MagCache is not for temporal reasoning (its cached residuals would be of the reasoning "
                        "frames' shape): leave one of them out")
    edit = edit_shape(pipe, size)
    if frames is None:
        frames = max(g.frames for g in pipe.manifest.shapes if g.size == edit.size)
    reason = pipe.shape(edit.size, frames)  # a frame count the bundle lacks: one line naming its shapes
    return reason, edit


def generate(pipe: Pipeline, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
             image: Any = None, last_image: Any = None, seed: int = 0, steps: int | None = None,
             guidance: float | None = None, guidance_2: float | None = None, flow_shift: float | None = None,
             latents: np.ndarray | None = None, progress: bool = True, magcache: MagCache | None = None,
             low_memory: bool = False, size: Size = None, frames: int | None = None,
             sampler: str | None = None, sigmas: Sequence[float] | None = None, *,
             temporal_reasoning_steps: int | None = 0, on_step: Callable[[int, int], None] | None = None,
             on_preview: Callable[[np.ndarray], None] | None = None, decoder: str = "full",
             on_frames: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """frames (B, 5, H, W, 3) float32 in [0, 1] (at Wan's 4x temporal scale): the edit of `image` as the prompt says,
    a short video from the image to the edit (its last frame), as ChronoEditPipeline makes it.

    `temporal_reasoning_steps` K > 0 (diffusers' enable_temporal_reasoning, num_temporal_reasoning_steps): the first K
    steps over `frames` frames (one of the bundle's frame counts at `size`; default its most), the rest on the edit's 2
    latent frames (the module docstring); `latents` is then the N-frame initial noise. K = 0 (default): every step on
    the edit shape, whose frames `frames` may only name. The rest as Pipeline.generate (runtime/pipeline.py)."""
    k = _steps(0 if temporal_reasoning_steps is None else temporal_reasoning_steps)
    if k == 0:  # diffusers forces num_frames=5: the edit shape's
        edit = edit_shape(pipe, size) if latents is None else pipe.shape_of_latents(np.shape(latents))
        if edit.latent_frames != EDIT_LATENT_FRAMES or (frames is not None and frames != edit.frames):
            asked = frames if latents is None else edit.frames
            raise UserError(f"ChronoEdit edits on {edit_shape(pipe, edit.size).frames} frames; {asked} frames are for "
                            "temporal reasoning (--temporal-reasoning-steps K / temporal_reasoning_steps=K)")
        return segment.generate(pipe, prompt, negative_prompt, image=image, last_image=last_image, seed=seed,
                                        steps=steps, guidance=guidance, guidance_2=guidance_2, flow_shift=flow_shift,
                                        latents=latents, progress=progress, magcache=magcache, low_memory=low_memory,
                                        size=edit.size, frames=edit.frames, sampler=sampler, sigmas=sigmas,
                                        on_step=on_step, on_preview=on_preview, decoder=decoder, on_frames=on_frames)
    pipe.prompts(prompt, "prompt")  # an empty prompt, a decoder the bundle lacks: before any loading
    pipe.decoder_programs(decoder)
    s = pipe.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
    if latents is not None:  # the N-frame noise picks N (frames, if given, must agree)
        shape = pipe.shape_of_latents(np.shape(latents))
        if (frames is not None and frames != shape.frames) or \
                (size is not None and pipe.shape(size, shape.frames) != shape):
            raise UserError(f"latents of shape {list(np.shape(latents))} are for {shape.describe()}, not the "
                            "size/frames asked for")
        size, frames = shape.size, shape.frames
    reason, edit = reasoning_shapes(pipe, k, s.steps, s.sampler, size, frames, magcache)
    for g in (reason, edit):
        pipe.start_loading(s, pipe.shape(g.size, g.frames), image=True, prompt=prompt, negative_prompt=negative_prompt)
    step_done = None
    if on_step is not None:
        def step_done(i: int) -> None:
            on_step(i + 1, s.steps)
    try:
        embeds = pipe.encode(prompt, negative_prompt, image, last_image, reason.size, reason.frames)
        if low_memory:
            pipe.unload_before("denoise")
        state = segment.denoise(pipe, embeds, s, latents, progress, step_done, size=reason.size,
                                frames=reason.frames, stop_after=k, on_preview=on_preview)
        # diffusers at step K: latents, condition, scheduler.model_outputs and last_sample all [:, :, [0, -1]]
        edited = {**embeds, "condition": np.ascontiguousarray(embeds["condition"][:, :, TRIM])}
        state = np.ascontiguousarray(state[:, :, :, TRIM])
        out = segment.denoise(pipe, edited, s, None, progress, step_done, size=edit.size, frames=edit.frames,
                              resume=(k, state), on_preview=on_preview)
        if low_memory:
            pipe.unload_before("decode")
        video = pipe.decode(out, decoder)
        if on_frames is not None:
            on_frames(video)
        return video
    except BaseException:
        pipe.bundle.cancel_prefetch()
        raise


def last_frame(frames: np.ndarray, index: int = 0) -> Image.Image:
    """Video `index` of a batch of frames (B, F, H, W, 3) in [0, 1] -> its last frame as a PIL RGB image (x 255,
    truncated, as diffusers' export and ChronoEdit's script save it)."""
    from PIL import Image

    return Image.fromarray(to_uint8(np.asarray(frames)[index, -1]))  # uint8 (H, W, 3): RGB


def edit_image(pipe: Any, image: Any, prompt: str, negative_prompt: str = "", seed: int = 0, steps: int | None = None,
               guidance: float | None = None, temporal_reasoning_steps: int = 0, frames: int | None = None,
               **kwargs: Any) -> Image.Image:
    """The edited image: a PIL RGB image of the bundle shape's size, the last frame of `pipe.generate`'s short video
    (the first video of a batch bundle's). `image`: a PIL image, a path or a uint8 (H, W, 3) array (resized to the
    shape's size as the pipeline does); `kwargs`: generate's others (size, sampler, flow_shift, sigmas, latents,
    progress, on_step, on_preview, loras, decoder, low_memory, magcache). UserError for a bundle that does not edit
    images, or bad input, before any work."""
    kind: Kind = pipe.kind
    if not kind.chronoedit:
        raise UserError(f"this bundle is {kind.title}: edit_image is for image-editing models (ChronoEdit); "
                        "generate makes its videos")
    if image is None:
        raise UserError("edit_image needs the image to edit")
    frames_out = pipe.generate(prompt, negative_prompt, image=image, seed=seed, steps=steps, guidance=guidance,
                               temporal_reasoning_steps=temporal_reasoning_steps, frames=frames, **kwargs)
    return last_frame(frames_out)


def is_image_path(path: str | Path) -> bool:
    """Whether `runtime generate --out` names an image (the edit) rather than a video."""
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def check_out(kind: Kind, path: str | Path) -> None:
    """An image out is an image-editing bundle's edit: refuse it for the others in one line, before any work."""
    if is_image_path(path) and not kind.chronoedit:
        raise UserError(f"this bundle is {kind.title}: it makes videos, and {Path(path).name} names an image (a .png "
                        "out is an image-editing bundle's edit): name the output .mp4, .mkv, .mov or .gif")


def write_images(frames: np.ndarray, path: str | Path) -> list[Path]:
    """Each video's last frame as a PNG, atomically: `path`, or NAME-<i>.png for each video when B > 1."""
    path = Path(path)
    b = np.shape(frames)[0]
    paths = [path] if b == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(b)]
    for i, p in enumerate(paths):
        with atomic_path(p) as tmp:
            last_frame(frames, i).save(tmp, format="PNG")
    return paths
