"""SkyReels-V2 diffusion forcing: a video of any length from one bundle, as diffusers' SkyReelsV2DiffusionForcing
pipelines make it (text-to-video, image-to-video and video extension: `...Pipeline`, `...ImageToVideoPipeline`,
`...VideoToVideoPipeline`).

Every latent frame has its own noise level. A run is a plan of rows (`timestep_matrix`): row r gives each frame its
timestep and says which frames step, each frame stepping its own sampler (its k-th step takes the schedule's row k,
so UniPC keeps a history per frame, as diffusers' one deep-copied scheduler per frame). Synchronous (ar_step 0): N
rows, every frame at the same level. Asynchronous (ar_step > 0, causal_block_size): blocks of frames start ar_step
rows after the block before, a staircase of N + (blocks - 1) x ar_step rows under block-causal attention.

A bundle's shape is one segment of B latent frames (diffusers' base_num_frames). A video of L > B latent frames is
made in segments overlapping by O = (overlap_history - 1) // 4 + 1 latent frames:

    segments    n = 1 + (L - B - 1) // (B - O) + 1
    segment i   min(L - (i (B - O) + O) + O, B) latent frames (B for the first), its first P = O - O % block
                pinned to the last O accumulated frames' first P, kept at t = 0 (or re-noised: addnoise_condition)
    the video   segment 0, then each later segment's frames after the first O, each segment's decoded as it
                ends (the VAE's memory carried: the same frames as one decode of all of it)

A video of L <= B frames is one segment of L frames (a bundle shape of that many frames must exist), as is the last
segment's shorter length. Image-to-video pins the image's latent as frame 0 of the first segment (and a last image,
one latent frame after the last segment's); video extension pins the source's last overlap_history frames (their
latents) in the first segment and returns the source followed by the decoded frames (the prefix decoded again), as
diffusers does.

Each segment's initial noise is `latents[i]` (one per segment, diffusers' draws for parity) or drawn from the seed;
the re-noise of pinned frames is drawn from the seed per segment and row (`prefix_noise`; diffusers draws it with
torch's global generator).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import images, scheduler, video_input
from . import manifest as mf
from . import steps as runner
from .distributed import fetch, put
from .errors import UserError
from .noise import seed_noise, segment_noise

Pipeline = Any  # the front (runtime/pipeline.py), which imports this loop: the loop calls its public methods

DEFAULT_OVERLAP = 17  # frames; diffusers requires one for long videos and recommends 17 or 37
NOT_STARTED = 999  # the timestep diffusers feeds frames whose first step is still to come


class InputError(UserError):
    """A diffusion forcing setting that cannot run; `field` names it (the API's field, the Python keyword)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Segment:
    frames: int  # latent frames the segment makes (its initial noise's), pinned ones included
    prefix: int  # leading latent frames pinned: the image, the source's last frames or the segment before's overlap
    end: bool = False  # one more pinned latent frame after them: the last image (the last segment)

    @property
    def dit_frames(self) -> int:
        """The latent frames the DiT sees: the bundle shape this segment runs on has 4 (dit_frames - 1) + 1."""
        return self.frames + self.end


@dataclass(frozen=True)
class Plan:
    latent_frames: int  # of the video made (decoded), L
    base: int  # latent frames of a full segment, B
    overlap: int  # latent frames each later segment takes from the one before, O
    block: int  # the causal block size (1: none)
    segments: tuple[Segment, ...]


def latent_count(frames: int, temporal_scale: int = 4) -> int:
    return (frames - 1) // temporal_scale + 1


def pixel_count(latent_frames: int, temporal_scale: int = 4) -> int:
    return temporal_scale * (latent_frames - 1) + 1


def frames_for(seconds: float, fps: int, temporal_scale: int = 4) -> int:
    """The frame count (4k + 1) at or above seconds x fps: what a duration asks a diffusion forcing bundle for."""
    wanted = max(1, math.ceil(seconds * fps - 1e-9))
    return -(-(wanted - 1) // temporal_scale) * temporal_scale + 1


def plan(latent_frames: int, base: int, overlap_history: int | None, block: int = 1, first_prefix: int = 0,
         end: bool = False, extend: bool = False, temporal_scale: int = 4) -> Plan:
    """The segments of a run of `latent_frames` (L) in segments of `base` (B) latent frames, as diffusers plans them:
    one segment of L when L <= B (text and image), the long-video plan otherwise and always for video extension
    (`extend`). `first_prefix`: the first segment's pinned frames (1 for an image, the source's for an extension);
    `end`: a last image, pinned after the last segment. InputError for an overlap that leaves no new frames."""
    long = extend or latent_frames > base
    if not long:
        return Plan(latent_frames, base, 0, block, (Segment(latent_frames, first_prefix, end),))
    history = DEFAULT_OVERLAP if overlap_history is None else overlap_history
    overlap = latent_count(history, temporal_scale)
    if overlap >= base or (extend and overlap >= latent_frames):
        most = pixel_count(min(base, latent_frames) - 1, temporal_scale)
        raise InputError(f"overlap_history {history} is {overlap} latent frames, which leaves no new frames "
                         f"in segments of {min(base, latent_frames)} latent frames: give an overlap_history of at most "
                         f"{most} frames", "overlap_history")
    count = 1 + (latent_frames - base - 1) // (base - overlap) + 1
    segments = []
    for i in range(count):
        if i == 0:
            n = min(latent_frames, base)
            prefix = first_prefix
        else:
            n = min(latent_frames - (i * (base - overlap) + overlap) + overlap, base)
            prefix = overlap - overlap % block
        segments.append(Segment(n, prefix, end and i == count - 1))
    return Plan(latent_frames, base, overlap, block, tuple(segments))


def timestep_matrix(frames: int, steps: int, ar_step: int = 0, pre_ready: int = 0, block: int = 1
                    ) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' generate_timestep_matrix: (index, update), each (rows, frames). index[r, f] is frame f's place in
    [not started, the schedule's N timesteps, done] (0 .. N + 1) at row r; update[r, f] says whether it steps then
    (its k-th step where index is k). Blocks of `block` frames start `ar_step` rows after the block before them (0:
    all at once); the first `pre_ready` // block blocks are done from the start (pinned frames)."""
    n_iter = steps + 1
    blocks = frames // block
    before = np.zeros(blocks, np.int64)
    before[: pre_ready // block] = n_iter
    rows, updates = [], []
    while not np.all(before >= n_iter - 1):
        row = np.zeros(blocks, np.int64)
        for i in range(blocks):
            row[i] = before[i] + 1 if i == 0 or before[i - 1] >= n_iter - 1 else row[i - 1] - ar_step
        row = np.clip(row, 0, n_iter)
        updates.append((row != before) & (row != n_iter))
        rows.append(row)
        before = row
    if not rows:  # every frame pinned: nothing to run
        return np.zeros((0, frames), np.int64), np.zeros((0, frames), bool)
    return np.repeat(np.stack(rows), block, axis=1), np.repeat(np.stack(updates), block, axis=1)


def prefix_noise(seed: int, segment: int, row: int, shape: tuple[int, ...]) -> np.ndarray:
    """The Gaussian noise re-noising the pinned frames (addnoise_condition) at `row` of `segment`, from `seed` (the
    pinned frames take their share of it; diffusers draws it with torch.randn_like). On the host, as every process
    of a multi-host job draws it alike and places its own shards."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0x5EED0 + segment), row)
    return np.asarray(jax.random.normal(key, shape, jnp.float32))


def check_settings(ar_step: Any, causal_block_size: Any, addnoise_condition: Any, overlap_history: Any,
                   num_frames: Any) -> tuple[int, int, float]:
    """(ar_step, causal block size, addnoise_condition) checked; InputError naming the field otherwise."""
    def integer(value: Any, name: str, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise InputError(f"{name} must be an integer >= {low}, got {value!r}", name)
        return int(value)

    ar = integer(0 if ar_step is None else ar_step, "ar_step", 0)
    block = 1 if causal_block_size is None else integer(causal_block_size, "causal_block_size", 1)
    if ar > 0 and causal_block_size is None:
        raise InputError(f"ar_step {ar} (the asynchronous mode) needs causal_block_size too: the frames per causal "
                         "block (e.g. causal_block_size 5, diffusers' recommendation)", "ar_step")
    if overlap_history is not None:
        integer(overlap_history, "overlap_history", 1)
    if num_frames is not None:
        integer(num_frames, "num_frames", 1)
    a = 0 if addnoise_condition is None else addnoise_condition
    if isinstance(a, bool) or not isinstance(a, (int, float, np.integer, np.floating)) or not math.isfinite(a) \
            or not 0 <= a < 1000:
        raise InputError(f"addnoise_condition must be a number in [0, 1000) (the timestep pinned frames are re-noised "
                         f"to; 20 is diffusers' recommendation), got {a!r}", "addnoise_condition")
    return ar, block, float(a)


def frame_counts(pipe: Pipeline, size: Any, segment_frames: int | None) -> tuple[mf.Geometry, list[int]]:
    """The segment shape (`segment_frames`: frames of one of the bundle's shapes; None: the longest of `size`) and
    the latent frame counts the bundle has shapes for at its size."""
    g = pipe.shape(size, segment_frames)
    same = [s for s in pipe.manifest.shapes if s.size == g.size and s.reference_images == 0]
    if segment_frames is None:
        g = max(same, key=lambda s: s.frames)
    return g, sorted({s.latent_frames for s in same})


@dataclass(frozen=True)
class Layout:
    """What a run makes, checked before any work: the segment shape, the segment plan and the settings."""

    shape: mf.Geometry  # the segment's bundle shape (base_num_frames)
    plan: Plan
    num_frames: int  # what is made (video extension: after the source, counting the re-decoded overlap)
    ar_step: int
    block: int  # causal block size (1: none)
    addnoise: float
    overlap: int  # overlap_history, frames (the source's clip for a video extension)
    first_prefix: int  # the first segment's pinned latent frames

    def rows(self, steps: int) -> list[int]:
        """Each segment's rows (DiT calls) at `steps` steps: what progress counts, and a server's step limit."""
        return [len(timestep_matrix(seg.dit_frames, steps, self.ar_step, seg.prefix, self.block)[0])
                for seg in self.plan.segments]


def layout(pipe: Pipeline, size: Any = None, frames: int | None = None, num_frames: Any = None,
           overlap_history: Any = None, ar_step: Any = 0, causal_block_size: Any = None, addnoise_condition: Any = 0,
           images: int = 0, video_frames: int | None = None) -> Layout:
    """The run a request makes on this bundle (`images`: 0, 1 or 2 with a last image; `video_frames`: a source video's
    frame count), or InputError naming the field: settings out of range, an overlap that leaves no new frames, a
    causal block size that does not divide a segment, ar_step without causal_block_size, a source video too short, a
    frame count no shape or segment plan makes."""
    ar, block, addnoise = check_settings(ar_step, causal_block_size, addnoise_condition, overlap_history, num_frames)
    g, counts = frame_counts(pipe, size, frames)
    n = g.frames if num_frames is None else int(num_frames)
    if (n - 1) % g.temporal_scale:
        low = max(1, (n - 1) // g.temporal_scale * g.temporal_scale + 1)
        raise InputError(f"num_frames {n} is not of the form {g.temporal_scale}k+1: try {low} or "
                         f"{low + g.temporal_scale}", "num_frames")
    overlap = DEFAULT_OVERLAP if overlap_history is None else int(overlap_history)
    first_prefix = 1 if images else 0
    if video_frames is not None:
        if video_frames < overlap:
            raise InputError(f"the video has {video_frames} frame{'s' * (video_frames != 1)}, fewer than "
                             f"overlap_history {overlap}: a video to extend needs at least overlap_history frames "
                             "(give a longer video or a smaller overlap_history)", "video")
        first_prefix = latent_count(_encodable(overlap, g.temporal_scale), g.temporal_scale)
        first_prefix -= first_prefix % block
    p = plan(latent_count(n, g.temporal_scale), g.latent_frames, overlap if video_frames is not None else
             overlap_history, block, first_prefix, images > 1, video_frames is not None, g.temporal_scale)
    check_plan(p, counts, g, n)
    return Layout(g, p, n, ar, block, addnoise, overlap, first_prefix)


def check_plan(p: Plan, counts: list[int], g: mf.Geometry, num_frames: int, field: str = "num_frames") -> None:
    """Every segment must run on a bundle shape and divide into causal blocks; InputError otherwise."""
    for i, seg in enumerate(p.segments):
        which = "the video" if len(p.segments) == 1 else f"segment {i + 1} of {len(p.segments)}"
        if seg.dit_frames % p.block:
            raise InputError(f"causal_block_size {p.block} does not divide {which}'s {seg.dit_frames} latent frames: "
                             f"give a causal block size that divides it (the segments of {num_frames} frames here "
                             f"have {', '.join(str(s.dit_frames) for s in p.segments)} latent frames)",
                             "causal_block_size")
        if seg.dit_frames not in counts:
            made = ", ".join(str(pixel_count(n, g.temporal_scale)) for n in counts)
            end = " (with the last image)" if seg.end else ""
            need = pixel_count(seg.dit_frames, g.temporal_scale)
            raise InputError(f"{num_frames} frames need {which}{end} to be {need} frames, and this bundle's shapes at "
                             f"{g.size} have {made}: ask for "
                             f"{suggest(counts, p, g.temporal_scale)}, or export the bundle with --frames "
                             f"{g.frames},{pixel_count(seg.dit_frames, g.temporal_scale)}", field)


def suggest(counts: list[int], p: Plan, temporal_scale: int) -> str:
    """Frame counts this bundle makes in whole segments of its longest shape (with the overlap asked)."""
    base = max(counts)
    if p.overlap == 0 or p.overlap >= base:
        return " or ".join(str(pixel_count(n, temporal_scale)) for n in counts)
    whole = [base + k * (base - p.overlap) for k in range(3)]
    return ", ".join(str(pixel_count(n, temporal_scale)) for n in whole) + ", ..."


@dataclass
class Run:
    """A run's fixed parts: the settings and what every step program takes whatever the segment."""

    pipe: Pipeline
    plan: scheduler.Plan
    guidance: float
    block: int
    ar_step: int
    addnoise: float
    fps: int
    seed: int
    dtype: Any  # the model's: pinned latents are rounded to it, as diffusers' .to(transformer_dtype)
    kv: Any = None


def generate(pipe: Pipeline, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
             image: Any = None, last_image: Any = None, video: Any = None, num_frames: int | None = None,
             overlap_history: int | None = None, ar_step: int | None = 0, causal_block_size: int | None = None,
             addnoise_condition: float | None = 0, fps: int | None = None, seed: int = 0, steps: int | None = None,
             guidance: float | None = None, guidance_2: float | None = None, flow_shift: float | None = None,
             sampler: str | None = None, sigmas: Sequence[float] | None = None, latents: Any = None,
             progress: bool = True, magcache: Any = None, low_memory: bool = False, size: Any = None,
             frames: int | None = None, on_step: Callable[[int, int], None] | None = None,
             on_preview: Callable[[np.ndarray], None] | None = None, decoder: str = "full",
             on_frames: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """frames (B, F, H, W, 3) float32 in [0, 1]: `num_frames` frames (4k + 1; default: the segment's) from the prompt,
    the prompt and `image` (+ `last_image`), or after the source `video` (then F = the source's frames + num_frames,
    the first num_frames counting the re-decoded overlap, as diffusers returns it). `size` and `frames` pick the
    segment shape (frames: base_num_frames; default the longest of the size; `frames` alone is the video's length,
    as the CLI's --frames); `overlap_history` (frames, default
    17 where the video needs segments), `ar_step` and `causal_block_size` (the asynchronous mode),
    `addnoise_condition` (re-noise pinned frames to that timestep) and `fps` (the frame rate the DiT is told,
    default the bundle's) as diffusers'. `latents`: one initial noise per segment (B, z, frames, h, w), or the
    first segment's. `on_step(done, total)` follows every row of every segment (it may raise to stop the run: a
    server's cancel), `on_preview(rgb)` gets each row's estimate of the segment's middle frame (Pipeline.denoise).
    `on_frames(frames)` gets the video's frames in order as they are final, (B, f, H, W, 3) each (a video extension's
    source first): each segment's new frames are decoded as soon as it ends (the frames the next segment pins are
    final already), the decoder's memory carried from segment to segment (Pipeline.frame_decoder), so what it is
    given joins into the video returned. With `low_memory` and no `on_frames`, the video is decoded at the end
    instead, after the DiT's weights are dropped. The rest as Pipeline.generate."""
    if magcache is not None:
        raise UserError("MagCache is not for diffusion forcing: its per-frame timesteps give MagCache's per-step "
                        "schedule nothing to go by; leave magcache out")
    pipe.prompts(prompt, "prompt")
    pipe.decoder_programs(decoder)  # a decoder the bundle lacks fails before any work
    if num_frames is None and frames is not None:  # as the CLI's --frames: the video's length
        num_frames, frames = frames, None
    if last_image is not None and image is None:
        raise InputError("a last image needs a first image too (--image / image=...)", "last_image")
    if video is not None and image is not None:
        raise InputError("give an image (image-to-video) or a video to extend, not both", "image")
    source = None if video is None else video_input.load_frames(video, "video")
    pil = [] if image is None else [images.load_image(image, "image")]
    if last_image is not None:
        pil.append(images.load_image(last_image, "last image"))
    lay = layout(pipe, size, frames, num_frames, overlap_history, ar_step, causal_block_size, addnoise_condition,
                 len(pil), None if source is None else len(source))
    fps = pipe.manifest.defaults.fps if fps is None else fps
    if isinstance(fps, bool) or not isinstance(fps, (int, np.integer)) or not 1 <= fps <= 240:
        raise InputError(f"fps must be an integer in 1..240, got {fps!r}", "fps")
    g, p, ar, block, overlap, first_prefix = lay.shape, lay.plan, lay.ar_step, lay.block, lay.overlap, lay.first_prefix
    s = pipe.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
    shapes = [pipe.manifest.find_shape(g.width, g.height, pixel_count(seg.dit_frames, g.temporal_scale), 0)
              for seg in p.segments]
    noise = segment_noise(latents, len(p.segments), [(*g.latent_shape[:2], seg.frames, *g.latent_shape[3:])
                                                     for seg in p.segments])
    sched = s.plan(pipe.scheduler_config)
    expert = pipe.expert_of(float(sched.timesteps[0]))
    programs = [runner.step_program(pipe.manifest, shape, expert, s.guidance_of(expert)) for shape in shapes]
    runner.timestep_cast(pipe.manifest, programs[0], sched.timesteps, s.sampler)
    rows = lay.rows(len(sched.timesteps))
    total = sum(rows)
    dtype = np.dtype(ml_dtypes.bfloat16) if pipe.manifest.dtype == "bf16" else np.dtype(np.float32)
    run = Run(pipe, sched, s.guidance, block, ar, lay.addnoise, int(fps), s.seed, dtype)

    pipe.start_loading(s, pipe.shape(g.size, g.frames), image=bool(pil) or source is not None, prompt=prompt,
                       negative_prompt=negative_prompt)
    bar = runner.progress_bar(total, progress)
    try:
        embeds = pipe.encode(prompt, negative_prompt, size=g.size, frames=g.frames)
        pinned = _pinned(pipe, g, pil, source, overlap, first_prefix, dtype)
        if low_memory:
            pipe.unload_before("denoise")
        context = np.concatenate([embeds["prompt_embeds"], embeds["negative_prompt_embeds"]]).astype(np.float32)
        run.kv = pipe.prompt_kv(context, 0, pipe.text_rows(context, programs))
        acc: np.ndarray | None = None
        done = 0
        streaming = on_frames is not None or not low_memory  # decode each segment as it ends (see the docstring)
        decode = pipe.frame_decoder(decoder)
        parts: list[np.ndarray] = []

        def emit(frames_: np.ndarray) -> None:
            parts.append(frames_)
            if on_frames is not None:
                on_frames(frames_)

        if source is not None:  # the source (resized, as diffusers' preprocess_video), then what is made
            pixels = video_input.video_pixels(source, g.width, g.height).transpose(0, 2, 3, 1)
            head = np.clip(pixels * np.float32(0.5) + np.float32(0.5), 0, 1).astype(np.float32)
            emit(np.repeat(head[None], g.batch, axis=0))
        for i, (seg, shape, name) in enumerate(zip(p.segments, shapes, programs, strict=True)):
            x0 = noise[i] if noise[i] is not None else seed_noise(s.seed, i, (*g.latent_shape[:2], seg.frames,
                                                                             *g.latent_shape[3:]))
            x0 = np.array(x0, np.float32)
            if i == 0 and seg.prefix:
                x0[:, :, : seg.prefix] = pinned["first"][:, :, : seg.prefix]
            elif seg.prefix:
                x0[:, :, : seg.prefix] = _round(acc[:, :, -p.overlap:][:, :, : seg.prefix], dtype)
            if seg.end:
                x0 = np.concatenate([x0, pinned["last"]], axis=2)

            def step_done(j: int, done: int = done) -> None:
                bar.update(1)
                if on_step is not None:
                    on_step(done + j + 1, total)

            out = denoise_segment(run, i, seg, shape, name, x0, step_done, on_preview)
            out = out[:, :, : seg.frames]  # the last image's frame goes
            new = out if acc is None else out[:, :, p.overlap:]
            acc = new if acc is None else np.concatenate([acc, new], axis=2)
            done += rows[i]
            if streaming:
                emit(decode(new))
        if not streaming:
            pipe.unload_before("decode")
            emit(decode(acc))
        return np.concatenate(parts, axis=1)
    except BaseException:
        pipe.bundle.cancel_prefetch()
        raise
    finally:
        bar.close()


def _encodable(frames: int, temporal_scale: int) -> int:
    """The frames of a clip the VAE encodes: diffusers' AutoencoderKLWan.encode takes the first frame and whole chunks
    of `temporal_scale` after it, dropping the rest."""
    return 1 + (frames - 1) // temporal_scale * temporal_scale


def _round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Pinned latents as the model dtype holds them (diffusers' prefix.to(transformer_dtype)), in float32."""
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def _pinned(pipe: Pipeline, g: mf.Geometry, pil: list[Any], source: list[Any] | None, overlap: int,
            first_prefix: int, dtype: np.dtype) -> dict[str, np.ndarray]:
    """The pinned latents (B, z, P, h, w) of the first segment ("first": the image's, or the source's last
    overlap_history frames') and of the last image ("last"), normalised, in the model dtype's precision."""
    out: dict[str, np.ndarray] = {}
    b = g.batch
    for key, image in zip(("first", "last"), pil):  # each image encoded alone, one latent frame
        latents = pipe.encode_video(images.vae_pixels(image, g.width, g.height)[None], g)
        out[key] = np.repeat(_round(latents, dtype), b, axis=0)
    if source is not None:
        clip = source[-overlap:][: _encodable(overlap, g.temporal_scale)]
        latents = pipe.encode_video(video_input.video_pixels(clip, g.width, g.height), g)
        out["first"] = np.repeat(_round(latents[:, :, :first_prefix], dtype), b, axis=0)
    return out


def denoise_segment(run: Run, index: int, seg: Segment, g: mf.Geometry, program: str, x0: np.ndarray,
                    on_row: Callable[[int], None] | None = None,
                    on_preview: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """One segment's rows on the bundle shape `g`, on the step runner (runtime/steps.py): float32 latents
    (B, z, dit_frames, h, w) from `x0` (its initial noise with the pinned frames in place). Each row is a step whose
    timestep is one per frame (the row of diffusers' timestep matrix) and whose sampler row is each frame's own.
    `on_row(r)` after each row, `on_preview(rgb)` before it with the row's estimate of the segment's middle frame
    (the per-frame states keep the scheduler's layout)."""
    pipe = run.pipe
    steps = len(run.plan.timesteps)
    index_m, update_m = timestep_matrix(seg.dit_frames, steps, run.ar_step, seg.prefix, run.block)
    if seg.end:  # the last image: pinned at t = 0, never stepped
        index_m[:, -1], update_m[:, -1] = steps + 1, False
    template = np.concatenate([[NOT_STARTED], run.plan.timesteps, [0]]).astype(np.float32)
    coeffs = frame_rows(run.plan.coeffs)
    blend = np.zeros(seg.dit_frames, np.float32)
    if run.addnoise > 0 and seg.prefix:
        blend[: seg.prefix] = np.float32(0.001 * run.addnoise)
    timesteps = []
    for r in range(len(index_m)):
        t = template[index_m[r]]
        if blend.any():  # as diffusers: the pinned frames fed at t = addnoise_condition, re-noised
            t[: seg.prefix] = run.addnoise
        timesteps.append(t)
    noise_sharding = dict(zip(pipe.program_inputs(program), pipe.bundle.call_shardings(program), strict=True))["noise"]

    def per_row(r: int) -> dict[str, Any]:
        rows = coeffs[np.clip(index_m[r] - 1, 0, steps - 1)] * update_m[r][:, None]
        values = {"kv": run.kv, "guidance": np.float32(run.guidance), "row": rows.astype(np.float32),
                  "update": update_m[r].astype(np.float32), "causal_block": np.int32(run.block),
                  "fps": np.int32(run.fps)}
        if blend.any():
            values["noise"] = put(prefix_noise(run.seed, index, r, x0.shape), noise_sharding)
        return values

    zeros = {} if blend.any() else {"noise": np.zeros(x0.shape, np.float32)}
    state = runner.initial_state(x0, scheduler.state_rows(pipe.scheduler_config.solver_order))
    state_dev = runner.run(pipe.bundle, g, [program] * len(index_m), state, timesteps, per_row,
                           fixed={"blend": blend, **zeros},
                           where=lambda r: f"row {r + 1} of {len(index_m)} of segment {index + 1}",
                           on_step=on_row, on_preview=on_preview)
    return fetch(state_dev)[0].astype(np.float32)


def frame_rows(coeffs: np.ndarray) -> np.ndarray:
    """The sampler rows of one frame's schedule as diffusers' diffusion forcing loop steps it: its frame k-th step takes
    row k, but UniPC's second step corrects from the frame's current sample where the row says the one before. diffusers
    steps each frame's scheduler on a view of the latents (`latents[:, :, idx]`), which the scheduler keeps as its
    `last_sample` on its first step (no corrector runs then, so the view itself), and the pipeline then writes the
    step's result into the latents: the view, and so the corrector's base of the next step, is that result. Row 1's
    coefficient of the previous corrected sample moves onto the current sample's. (Rows without a corrector, Euler's
    and DPM-Solver++'s, have none to move.)"""
    rows = np.array(coeffs, np.float32)
    if len(rows) > 1:  # row layout (runtime/scheduler.py): [sigma, c_x, c_xprev, ...]
        rows[1, 1] += rows[1, 2]
        rows[1, 2] = 0.0
    return rows


def extend(pipe: Pipeline, prompt: str | Sequence[str], video: Any, seconds: float | None = None,
           num_frames: int | None = None, fps: int | None = None, **kwargs: Any) -> np.ndarray:
    """Video extension (OpenAI's `POST /videos/extensions`, `client.videos.extend(prompt=, seconds=, video=)`): the
    source `video` followed by a continuation, `generate(prompt, video=video, num_frames=...)`. `seconds` of new
    video at `fps` (the bundle's by default) ask for num_frames = overlap_history + seconds x fps frames, rounded up
    to 4k + 1 (diffusers' num_frames counts the re-decoded overlap frames); or give `num_frames` itself. The rest
    as `generate`."""
    if (seconds is None) == (num_frames is None):
        raise InputError("give the length of the extension: seconds or num_frames (one of them)", "seconds")
    fps = pipe.manifest.defaults.fps if fps is None else fps
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            raise InputError(f"seconds must be a number > 0, got {seconds!r}", "seconds")
        overlap = kwargs.get("overlap_history") or DEFAULT_OVERLAP
        num_frames = frames_for(overlap / fps + seconds, fps, pipe.geometry.temporal_scale)
    return generate(pipe, prompt, video=video, num_frames=num_frames, fps=fps, **kwargs)
