"""Helios: a video of any length in chunks, as diffusers' HeliosPipeline makes it (text, image or video in).

A bundle's shape is one chunk of C latent frames (diffusers' num_latent_frames_per_chunk; the bundle's --frames is
4 (C - 1) + 1, 33 by default). Each chunk is denoised from its own noise while the DiT sees the clean latents made
before it, at three scales (history_sizes, 16, 2 and 1 latest frames: long, mid, short, zeros where the video has
none yet) plus the video's first latent frame (the image's, or the first chunk's own), so every chunk costs the
same and runs the same program:

    chunks      max(1, ceil(num_frames / (4 (C - 1) + 1)))
    chunk k     the history is the last 19 latent frames made (an image's or a source video's first), the prefix
                the first frame's latent (zeros for the first chunk of a text-to-video run)
    decode      each chunk's C latents alone (the VAE's memory starts afresh per chunk, as diffusers decodes), as
                soon as the chunk is done; the video is trimmed to 4k + 1 frames at the end

The schedule is HeliosScheduler's single-stage one: sigmas linspace(0.999, 0, N + 1)[:-1] (or custom ones), shifted
by mu from the chunk's token count (calculate_shift) where the scheduler shifts dynamically; UniPC (the rows of
runtime/scheduler.py, sigma_t clamped at 1e-8 as the scheduler does) or Euler on them, restarted every chunk.

Image-to-video encodes the image alone (the prefix) and as a still video of one chunk (its last latent: the history's
last frame); video-to-video encodes the source's first frame (the prefix) and its last whole chunks, each alone (the
history), and returns only the new chunks, as diffusers. Those latents are lightly noised first
(add_noise_to_image_latents / add_noise_to_video_latents, a sigma drawn uniformly in [min, max]), from the seed.
Where diffusers samples the VAE's posterior, the runtime takes its mean (its programs encode to the mean).

Each chunk's initial noise is `latents[k]` (one per chunk, diffusers' draws for parity) or drawn from the seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import images, loop_settings, samplers, scheduler, video_input
from . import manifest as mf
from . import steps as runner
from .distributed import fetch
from .errors import UserError
from .forcing import InputError
from .noise import seed_noise, segment_noise

Pipeline = Any  # the front (runtime/pipeline.py), which imports this loop: the loop calls its public methods

# A run's own settings, by diffusers' names (HeliosPipeline / HeliosPyramidPipeline's __call__), declared in the loops'
# table (runtime/loop_settings.py: the CLI's flags, the API's fields and generate's keywords are made from it).
SETTINGS = loop_settings.settings_of("helios")
SAMPLERS = ("unipc", "euler")  # HeliosScheduler's scheduler_type (its "dmd" is the distilled pyramid's)
SIGMA_FLOOR = 1e-8  # HeliosScheduler clamps sigma_t there (_sigma_to_alpha_sigma_t)
NOISE_RANGE = (0.111, 0.135)  # diffusers' default image_noise_sigma_min/max and video_noise_sigma_min/max


def calculate_shift(tokens: int, c: mf.Chunks) -> float:
    """HeliosPipeline's mu: linear in the chunk's token count, base_shift at base_image_seq_len tokens, max_shift at
    max_image_seq_len."""
    m = (c.max_shift - c.base_shift) / (c.max_image_seq_len - c.base_image_seq_len)
    return tokens * m + (c.base_shift - m * c.base_image_seq_len)


def time_shift(mu: float, sigmas: np.ndarray, kind: str) -> np.ndarray:
    """HeliosScheduler.time_shift(mu, 1.0, sigmas) in float64; a zero sigma stays zero (torch's 1 / 0 = inf)."""
    with np.errstate(divide="ignore"):
        inv = 1.0 / sigmas - 1.0
    a = math.exp(mu) if kind == "exponential" else mu
    return np.where(sigmas > 0, a / (a + inv), 0.0)


def plan(sampler: str, steps: int, chunks: mf.Chunks, config: scheduler.UniPCConfig, tokens: int,
         sigmas: Sequence[float] | None = None) -> scheduler.Plan:
    """A chunk's schedule as HeliosPipeline sets it (HeliosScheduler, stages=1, given the pipeline's sigmas): the
    timesteps the DiT sees (sigma x 1000), the sigmas and one `sampler` row per step."""
    s = np.linspace(0.999, 0.0, steps + 1)[:-1] if sigmas is None else np.asarray(sigmas, np.float64)
    sig = np.concatenate([s, [0.0]])
    if chunks.use_dynamic_shifting:
        sig = time_shift(calculate_shift(tokens, chunks), sig, chunks.time_shift_type)
    timesteps = sig[:-1] * config.num_train_timesteps
    if sampler == "unipc":
        return scheduler.plan_of(timesteps, sig, sig, config, floor=SIGMA_FLOOR)
    rows = samplers.euler_rows(sig, config.solver_order)
    return _frozen(scheduler.Plan(timesteps=timesteps.astype(np.float32), sigmas=sig.astype(np.float32),
                                  coeffs=rows.astype(np.float32)))


def _frozen(p: scheduler.Plan) -> scheduler.Plan:
    for a in (p.timesteps, p.sigmas, p.coeffs):
        a.setflags(write=False)
    return p


def stage_schedule(c: mf.Chunks, num_train_timesteps: int = 1000) -> tuple[list[float], list[tuple[float, float]]]:
    """HeliosScheduler.init_sigmas_for_each_stage (the same in HeliosDMDScheduler), in float64: each stage's original
    start sigma (what the renoising between stages corrects) and the (max, min) of its training timesteps."""
    n = num_train_timesteps
    s = 1.0 - np.linspace(1, 1 / n, n + 1)
    sigmas = np.flip(c.shift * s / (1 + (c.shift - 1) * s))[:-1].copy()
    timesteps = sigmas * n
    ori, distance = [], []
    for i in range(c.stages):
        start = max(int(c.stage_range[i] * n), 0)
        end = min(int(c.stage_range[i + 1] * n), n)
        start_sigma = float(sigmas[start])
        end_sigma = float(sigmas[end]) if end < n else 0.0
        ori.append(start_sigma)
        if i:
            o = 1 - start_sigma
            start_sigma = 1 - (1 / (math.sqrt(1 + 1 / c.gamma) * (1 - o) + o)) * o
        distance.append(start_sigma - end_sigma)
    total = sum(distance)
    ranges = []
    for i in range(c.stages):
        r0 = 0.0 if i == 0 else sum(distance[:i]) / total
        r1 = 0.9999999999999999 if i == c.stages - 1 else sum(distance[:i + 1]) / total
        t_max = min(float(timesteps[int(r0 * n)]), 999.0)
        t_min = float(timesteps[min(int(r1 * n), n - 1)])
        ranges.append((t_max, t_min))
    return ori, ranges


def stage_plan(sampler: str, steps: int, stage: int, c: mf.Chunks, config: scheduler.UniPCConfig, tokens: int,
               amplify: bool = False) -> scheduler.Plan:
    """Pyramid stage `stage`'s schedule as HeliosPyramidPipeline sets it (set_timesteps(steps, stage, mu=...)): the
    timesteps the DiT sees (truncated to whole numbers, as the pipeline's .to(torch.int64)), the sigmas, and one row
    per step: UniPC, Euler, or DMD (`c.distilled`: x0 = x - sigma v renoised to the next sigma towards the stage's
    start, HeliosDMDScheduler.step; its first chunk twice the steps with `amplify`)."""
    n = config.num_train_timesteps
    _, ranges = stage_schedule(c, n)
    t_max, t_min = ranges[stage]
    count = (2 * steps + 1 if amplify else steps + 1) if c.distilled else steps
    timesteps = np.linspace(t_max, t_min, count)
    train = np.linspace(0.999, 0, n + 1)[:-1]
    sig = np.concatenate([np.linspace(train[0], train[-1], count), [0.0]])
    if c.distilled:
        timesteps, sig = timesteps[:-1], np.concatenate([sig[:-2], sig[-1:]])
    if c.use_dynamic_shifting:
        sig = time_shift(calculate_shift(tokens, c), sig, c.time_shift_type)
        stage_ts = np.linspace(t_max, t_min, n + 1)[:-1]
        timesteps = stage_ts.min() + sig[:-1] * (stage_ts.max() - stage_ts.min())
    fed = np.trunc(timesteps)
    if c.distilled:
        rows = dmd_rows(timesteps, sig, config.solver_order)
    elif sampler == "unipc":
        p = scheduler.plan_of(fed, sig, sig, config, floor=SIGMA_FLOOR)
        return p
    else:
        rows = samplers.euler_rows(sig, config.solver_order)
    return _frozen(scheduler.Plan(timesteps=fed.astype(np.float32), sigmas=sig.astype(np.float32),
                                  coeffs=rows.astype(np.float32)))


def dmd_rows(timesteps: np.ndarray, sig: np.ndarray, order: int) -> np.ndarray:
    """HeliosDMDScheduler.step as rows over the step state (runtime/scheduler.py's layout), the state's second row
    holding the stage's start tensor (the corrector keeps it: xc = xprev): x0 = x - sigma v, then (1 - s') x0 + s'
    start, s' the next step's sigma (x0 itself on the last step). The sigmas are looked up as the scheduler does, at
    the timestep nearest each step's truncated one."""
    rows = np.zeros((len(timesteps), scheduler.row_size(order)), np.float64)

    def sigma_at(t: float) -> float:
        return float(sig[np.argmin(np.abs(timesteps - np.trunc(t)))])

    for i, row in enumerate(rows):
        row[0] = sigma_at(timesteps[i])
        row[2] = 1.0  # xc = xprev: the start carried on
        nxt = sigma_at(timesteps[i + 1]) if i < len(timesteps) - 1 else 0.0
        p = row[1 + order + 3:]
        p[0], p[1] = nxt, 1.0 - nxt
    return rows


def block_noise(key: jax.Array, shape: tuple[int, ...], gamma: float, patch: tuple[int, ...]) -> np.ndarray:
    """HeliosPyramidPipeline.sample_block_noise's distribution: Gaussian noise correlated within each ph x pw block,
    covariance (1 + gamma) I - gamma (the blocks' mean noise reduced), drawn from `key`. The factor is computed in
    float64 (diffusers' float32 Cholesky fails at its default gamma 1/3, where the covariance is singular)."""
    _, ph, pw = patch
    size = ph * pw
    cov = np.eye(size) * (1 + gamma) - np.ones((size, size)) * gamma + np.eye(size) * 1e-8
    w, v = np.linalg.eigh(cov)
    factor = v * np.sqrt(np.clip(w, 0, None))  # factor @ factor.T = cov (a Cholesky factor's distribution)
    b, ch, f, h, wd = shape
    z = np.asarray(jax.random.normal(key, (b * ch * f * (h // ph) * (wd // pw), size), jnp.float32), np.float64)
    noise = (z @ factor.T).reshape(b, ch, f, h // ph, wd // pw, ph, pw).transpose(0, 1, 2, 3, 5, 4, 6)
    return noise.reshape(shape).astype(np.float32)


def downsample(x: np.ndarray) -> np.ndarray:
    """F.interpolate(x, scale 1/2, "bilinear") x 2 on each frame, as the pyramid shrinks the noise: twice each 2x2
    block's mean."""
    b, c, f, h, w = x.shape
    return (x.reshape(b, c, f, h // 2, 2, w // 2, 2).mean(axis=(4, 6)) * 2).astype(np.float32)


def upsample(x: np.ndarray) -> np.ndarray:
    """F.interpolate(x, scale 2, "nearest") on each frame."""
    return np.repeat(np.repeat(x, 2, axis=3), 2, axis=4)


def chunk_count(num_frames: int, window: int) -> int:
    """HeliosPipeline's num_latent_chunk: whole chunks of `window` frames covering num_frames (at least one)."""
    return max(1, (num_frames + window - 1) // window)


def output_frames(chunks: int, window: int, temporal_scale: int = 4) -> int:
    """The frames a run of `chunks` chunks returns: every chunk's decoded frames, trimmed to 4k + 1."""
    return (chunks * window - 1) // temporal_scale * temporal_scale + 1


def _noise_range(low: Any, high: Any, what: str) -> tuple[float, float]:
    for v, name in ((low, f"{what}_noise_sigma_min"), (high, f"{what}_noise_sigma_max")):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not 0 <= v <= 1:
            raise InputError(f"{name} must be a number in [0, 1], got {v!r}", name)
    if low > high:
        raise InputError(f"{what}_noise_sigma_min {low} is above {what}_noise_sigma_max {high}",
                         f"{what}_noise_sigma_min")
    return float(low), float(high)


def _renoise(x: np.ndarray, sigma: np.ndarray | float, key: jax.Array) -> np.ndarray:
    """sigma x N(0, 1) + (1 - sigma) x: how HeliosPipeline lightly noises the clean latents it is given."""
    noise = np.asarray(jax.random.normal(key, x.shape, jnp.float32))
    return (sigma * noise + (1 - sigma) * x).astype(np.float32)


def _uniform(key: jax.Array, n: int, low: float, high: float) -> np.ndarray:
    return np.asarray(jax.random.uniform(key, (n,), jnp.float32)) * (high - low) + low


def generate(pipe: Pipeline, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
             image: Any = None, video: Any = None, num_frames: int | None = None, seed: int = 0,
             steps: int | None = None, guidance: float | None = None, sampler: str | None = None,
             sigmas: Sequence[float] | None = None, latents: Any = None, noise: Any = None,
             add_noise_to_image_latents: bool | None = None, image_noise_sigma_min: float | None = None,
             image_noise_sigma_max: float | None = None, add_noise_to_video_latents: bool | None = None,
             video_noise_sigma_min: float | None = None, video_noise_sigma_max: float | None = None,
             is_skip_first_chunk: bool | None = None, pyramid_num_inference_steps_list: Sequence[int] | None = None,
             use_zero_init: bool | None = None, zero_steps: int | None = None,
             is_amplify_first_chunk: bool | None = None, is_cfg_zero_star: bool | None = None,
             progress: bool = True, size: Any = None,
             frames: int | None = None, on_step: Callable[[int, int], None] | None = None,
             on_preview: Callable[[np.ndarray], None] | None = None, decoder: str = "full",
             on_frames: Callable[[np.ndarray], None] | None = None, flow_shift: float | None = None,
             guidance_2: float | None = None, magcache: Any = None, low_memory: bool = False,
             fps: int | None = None) -> np.ndarray:
    """frames (B, F, H, W, 3) float32 in [0, 1]: a video of `num_frames` frames (default: one chunk; rounded up to
    whole chunks, then trimmed to 4k + 1) from the prompt, the prompt and `image`, or after the source `video` (only
    the new frames, as diffusers). `frames` alone is the video's length (as the CLI's --frames); `size` picks the
    bundle shape. diffusers' settings by its names: add_noise_to_image_latents (default True),
    image_noise_sigma_min/max (0.111, 0.135), add_noise_to_video_latents and video_noise_sigma_min/max (the same),
    is_skip_first_chunk; a pyramid bundle's pyramid_num_inference_steps_list (default `steps` per stage),
    is_cfg_zero_star (CFG-Zero* guidance; default the bundle's, model_index.json's), use_zero_init and zero_steps
    (CFG-Zero*'s first steps of zeros: True, 1), is_amplify_first_chunk (the distilled model's first chunk at twice
    the steps). `latents`: one initial noise per chunk (B, z, C, h, w, at full
    resolution), or the first chunk's; `noise`: a pyramid's renoising draws, per chunk a list of one per stage after
    the first (as diffusers adds them: sample_block_noise's). `on_step(done, total)` after every step of every chunk
    (it may raise to stop the run), `on_preview(rgb)` with each full-resolution step's estimate of the chunk's middle
    frame, `on_frames(frames)` with each chunk's frames as soon as it is decoded. The rest as Pipeline.generate;
    `sampler` is "unipc" or "euler" (HeliosScheduler's; a distilled bundle steps with its DMD scheduler), `sigmas`
    one per step before the shift (not for a pyramid, whose stages set theirs). flow_shift, guidance_2 and MagCache
    have no meaning here (the shift is computed per chunk) and are refused; `low_memory` changes nothing (each chunk
    is decoded as it is made); `fps` is the mp4's only."""
    if magcache is not None:
        raise UserError("MagCache is not for Helios: leave magcache out")
    pipe.prompts(prompt, "prompt")
    pipe.decoder_programs(decoder)  # a decoder the bundle lacks fails before any work
    if num_frames is None and frames is not None:  # as the CLI's --frames: the video's length
        num_frames, frames = frames, None
    if video is not None and image is not None:
        raise InputError("give an image (image-to-video) or a video to continue, not both", "image")
    run = plan_run(pipe, size, frames, num_frames, seed, steps, guidance, sampler, sigmas, flow_shift, guidance_2,
                   noise, add_noise_to_image_latents, image_noise_sigma_min, image_noise_sigma_max,
                   add_noise_to_video_latents, video_noise_sigma_min, video_noise_sigma_max,
                   pyramid_num_inference_steps_list, use_zero_init, zero_steps, is_amplify_first_chunk,
                   is_cfg_zero_star)
    g, count, s, chunks, runs, total = run.shape, run.count, run.settings, run.chunks, run.runs, run.total
    window = g.frames
    source = None if video is None else video_input.load_frames(video, "video")
    if source is not None and len(source) < window:
        raise InputError(f"the video has {len(source)} frame{'s' * (len(source) != 1)}, fewer than one chunk of "
                         f"{window}: Helios continues a video from its last whole chunks of {window} frames",
                         "video")
    pil = None if image is None else images.load_image(image, "image")
    initial = segment_noise(latents, count, g.latent_shape)
    renoise = _renoise_draws(noise, count, g, chunks.stages)
    add_image, add_video, image_range, video_range = run.add_image, run.add_video, run.image_range, run.video_range

    pipe.start_loading(pipe.settings(s.seed, s.steps, s.guidance, None, None, s.sampler, s.sigmas),
                       pipe.shape(g.size, g.frames), image=pil is not None or source is not None, prompt=prompt,
                       negative_prompt=negative_prompt)
    bar = runner.progress_bar(total, progress)
    try:
        embeds = pipe.encode(prompt, negative_prompt, size=g.size, frames=g.frames)
        key = jax.random.fold_in(jax.random.key(s.seed), 0x4E110)
        prefix, history = _start(pipe, g, chunks, pil, source, add_image, add_video, image_range, video_range, key)
        context = np.concatenate([embeds["prompt_embeds"], embeds["negative_prompt_embeds"]]).astype(np.float32)
        kv = pipe.prompt_kv(context, 0, pipe.text_rows(context, runs[0].programs[:1]))
        keep = output_frames(count, window, g.temporal_scale)
        parts: list[np.ndarray] = []
        made = done = 0
        for k in range(count):
            x0 = initial[k] if initial[k] is not None else seed_noise(s.seed, k, g.latent_shape)
            first = prefix if prefix is not None else np.zeros((*g.latent_shape[:2], 1, *g.latent_shape[3:]),
                                                               np.float32)
            hist = np.concatenate([first, history[:, :, -sum(chunks.history_sizes):]], axis=2)
            draws = renoise[k] or [block_noise(jax.random.fold_in(jax.random.fold_in(key, 0xB10C + k), st),
                                               _stage_shape(g, chunks.stages, st), chunks.gamma, chunks.patch_size)
                                   for st in range(1, chunks.stages)]

            def step_done(i: int, done: int = done) -> None:
                bar.update(1)
                if on_step is not None:
                    on_step(done + i + 1, total)

            out = _run_chunk(pipe, g, chunks, runs[k], kv, s.guidance, np.asarray(x0, np.float32), hist, draws,
                             step_done, on_preview)
            done += len(runs[k].programs)
            if prefix is None or (is_skip_first_chunk and k == 1):
                prefix = out[:, :, 0:1]
            history = np.concatenate([history, out], axis=2)
            part = pipe.frame_decoder(decoder)(out)[:, : max(0, keep - made)]  # each chunk alone, as diffusers
            made += part.shape[1]
            parts.append(part)
            if on_frames is not None:
                on_frames(part)
        return np.concatenate(parts, axis=1)
    except BaseException:
        pipe.bundle.cancel_prefetch()
        raise
    finally:
        bar.close()


@dataclass(frozen=True)
class ChunkRun:
    """One chunk's steps: per step, the program, the stage, the plan's row index and the guidance mode (kinds.py
    "helios" cfg_mode); per stage, its plan."""

    programs: list[str]
    stages: list[int]
    rows: list[int]
    modes: list[int]
    plans: list[scheduler.Plan]


@dataclass(frozen=True)
class Run:
    """What a Helios run makes, checked before any work: the chunk shape, the chunks, the settings, each chunk's steps
    and the total (what progress counts, and a server's step limit)."""

    shape: mf.Geometry
    count: int  # chunks
    num_frames: int  # the frames returned
    settings: Any  # runtime/settings.py DenoiseSettings
    chunks: mf.Chunks  # the bundle's, with the run's is_cfg_zero_star
    runs: list[ChunkRun]
    add_image: bool
    add_video: bool
    image_range: tuple[float, float]
    video_range: tuple[float, float]

    @property
    def total(self) -> int:
        return sum(len(r.programs) for r in self.runs)


def plan_run(pipe: Pipeline, size: Any = None, frames: int | None = None, num_frames: Any = None, seed: int = 0,
             steps: int | None = None, guidance: float | None = None, sampler: str | None = None,
             sigmas: Sequence[float] | None = None, flow_shift: float | None = None, guidance_2: float | None = None,
             noise: Any = None, add_noise_to_image_latents: Any = None, image_noise_sigma_min: Any = None,
             image_noise_sigma_max: Any = None, add_noise_to_video_latents: Any = None,
             video_noise_sigma_min: Any = None, video_noise_sigma_max: Any = None,
             pyramid_num_inference_steps_list: Any = None, use_zero_init: Any = None, zero_steps: Any = None,
             is_amplify_first_chunk: Any = None, is_cfg_zero_star: Any = None, is_skip_first_chunk: Any = None
             ) -> Run:
    """The run `generate` makes with these settings (as it takes them), or InputError naming the setting: what a
    server checks a request with before queueing it (is_skip_first_chunk changes no step: taken and not read)."""
    if flow_shift is not None:
        raise InputError("flow_shift is not a Helios setting: its scheduler shifts each chunk's sigmas by the chunk's "
                         "token count (the bundle's use_dynamic_shifting); leave flow_shift out", "flow_shift")
    if guidance_2 is not None:
        raise InputError("guidance_2 is for two-expert models; Helios has one transformer", "guidance_2")
    chunks = pipe.manifest.chunks
    if chunks is None:
        raise UserError("this bundle has no Helios chunk settings (manifest `chunks`): re-export it")
    if chunks.stages == 1:
        for name, value in (("pyramid_num_inference_steps_list", pyramid_num_inference_steps_list), ("noise", noise),
                            ("use_zero_init", use_zero_init), ("zero_steps", zero_steps),
                            ("is_amplify_first_chunk", is_amplify_first_chunk),
                            ("is_cfg_zero_star", is_cfg_zero_star)):
            if value is not None:
                raise InputError(f"{name} is for a Helios pyramid (HeliosPyramidPipeline); this bundle is "
                                 f"{pipe.kind.title}", name)
    elif sigmas is not None:
        raise InputError("sigmas: a Helios pyramid's stages set their own (give steps or "
                         "pyramid_num_inference_steps_list)", "sigmas")
    if chunks.distilled and sampler is not None:
        raise InputError("a distilled Helios samples with its DMD scheduler: leave sampler out", "sampler")
    g = pipe.shape(size, frames)
    n = g.frames if num_frames is None else num_frames
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise InputError(f"num_frames must be an integer >= 1, got {n!r}", "num_frames")
    count = chunk_count(int(n), g.frames)
    image_range = _noise_range(*(NOISE_RANGE[i] if v is None else v for i, v in
                                 enumerate((image_noise_sigma_min, image_noise_sigma_max))), "image")
    video_range = _noise_range(*(NOISE_RANGE[i] if v is None else v for i, v in
                                 enumerate((video_noise_sigma_min, video_noise_sigma_max))), "video")
    s = pipe.settings(seed, steps, guidance, None, None, None if chunks.distilled else sampler, sigmas)
    if s.sampler not in SAMPLERS:
        raise InputError(f"sampler {s.sampler} is not one of Helios' ({', '.join(SAMPLERS)})", "sampler")
    if is_cfg_zero_star is not None:  # the pipeline's config in diffusers; a run's setting here
        chunks = dataclasses.replace(chunks, cfg_zero_star=bool(is_cfg_zero_star))
    stage_steps = _stage_steps(pyramid_num_inference_steps_list, s.steps, chunks.stages)
    zero = _zero_init(use_zero_init, zero_steps)
    amplify = bool(is_amplify_first_chunk) and chunks.distilled  # (diffusers: a distilled pipeline's only)
    runs = [_chunk_run(pipe, g, chunks, s, stage_steps, amplify and k == 0, zero) for k in range(min(count, 2))]
    runs += [runs[-1]] * (count - len(runs))
    return Run(g, count, output_frames(count, g.frames, g.temporal_scale), s, chunks, runs,
               True if add_noise_to_image_latents is None else bool(add_noise_to_image_latents),
               True if add_noise_to_video_latents is None else bool(add_noise_to_video_latents),
               image_range, video_range)


def _stage_steps(given: Sequence[int] | None, steps: int, stages: int) -> list[int]:
    """Each stage's steps: pyramid_num_inference_steps_list, or `steps` for each."""
    if given is None:
        return [steps] * stages
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or len(given) != stages or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 1 <= v <= 1000 for v in given):
        raise InputError(f"pyramid_num_inference_steps_list must be {stages} integers in 1..1000 (the steps of each "
                         f"stage), got {given!r}", "pyramid_num_inference_steps_list")
    return [int(v) for v in given]


def _zero_init(use_zero_init: bool | None, zero_steps: int | None) -> int:
    """How many leading steps of the first stage CFG-Zero* zeroes (diffusers: the steps i <= zero_steps, with
    use_zero_init): -1 for none."""
    if zero_steps is not None and (isinstance(zero_steps, bool) or not isinstance(zero_steps, (int, np.integer))
                                   or zero_steps < 0):
        raise InputError(f"zero_steps must be an integer >= 0, got {zero_steps!r}", "zero_steps")
    return (1 if zero_steps is None else int(zero_steps)) if use_zero_init is None or use_zero_init else -1


def _chunk_run(pipe: Pipeline, g: mf.Geometry, chunks: mf.Chunks, s: Any, stage_steps: list[int], amplify: bool,
               zero: int) -> ChunkRun:
    """The steps of a chunk: HeliosPipeline's one schedule, or each pyramid stage's (its own resolution's programs)."""
    config = pipe.scheduler_config
    patch = int(np.prod(chunks.patch_size))
    programs, stages, rows, modes, plans = [], [], [], [], []
    for st in range(chunks.stages):
        # diffusers computes a stage's mu from the latents before it doubles them: the stage before's size
        f = 2 ** (chunks.stages - 1 - max(st - 1, 0))
        tokens = g.latent_frames * (g.latent_height // f) * (g.latent_width // f) // patch
        if chunks.stages == 1:
            p = plan(s.sampler, s.steps, chunks, config, tokens, s.sigmas)
        else:
            p = stage_plan(s.sampler, stage_steps[st], st, chunks, config, tokens, amplify)
        plans.append(p)
        for i in range(len(p.timesteps)):
            programs.append(runner.step_program(pipe.manifest, g, 0, s.guidance, st, chunks.stages))
            stages.append(st)
            rows.append(i)
            modes.append(2 if st == 0 and i <= zero and chunks.cfg_zero_star else int(chunks.cfg_zero_star))
    return ChunkRun(programs, stages, rows, modes, plans)


def _stage_shape(g: mf.Geometry, stages: int, stage: int) -> tuple[int, ...]:
    f = 2 ** (stages - 1 - stage)
    b, z, t, h, w = g.latent_shape
    return (b, z, t, h // f, w // f)


def _renoise_draws(noise: Any, count: int, g: mf.Geometry, stages: int) -> list[list[np.ndarray] | None]:
    """A pyramid's given renoising draws: per chunk, one per stage after the first (its shape), or None (the seed's)."""
    if noise is None:
        return [None] * count
    if not isinstance(noise, (list, tuple)) or not 1 <= len(noise) <= count:
        raise InputError(f"noise: give, per chunk (up to {count}), a list of {stages - 1} renoising draws (one per "
                         "stage after the first)", "noise")
    out: list[list[np.ndarray] | None] = []
    for k, per in enumerate(noise):
        if not isinstance(per, (list, tuple)) or len(per) != stages - 1:
            raise InputError(f"noise {k}: give {stages - 1} renoising draws (one per stage after the first)", "noise")
        draws = []
        for st, x in enumerate(per, start=1):
            a = np.asarray(x, np.float32)
            if a.shape != _stage_shape(g, stages, st) or not np.isfinite(a).all():
                raise InputError(f"noise {k}, stage {st + 1}: must be finite, of shape "
                                 f"{list(_stage_shape(g, stages, st))} (got {list(a.shape)})", "noise")
            draws.append(a)
        out.append(draws)
    return out + [None] * (count - len(out))


def _run_chunk(pipe: Pipeline, g: mf.Geometry, chunks: mf.Chunks, run: ChunkRun, kv: Any, guidance: float,
               x0: np.ndarray, history: np.ndarray, draws: list[np.ndarray], on_step: Callable[[int], None],
               on_preview: Callable[[np.ndarray], None] | None) -> np.ndarray:
    """A chunk's latents from its full-resolution noise `x0`: one schedule, or the pyramid's stages (the noise shrunk
    to the first stage's size; before each later stage the latents doubled in size and renoised with `draws`)."""
    x = x0
    for _ in range(chunks.stages - 1):
        x = downsample(x)
    ori, _ = stage_schedule(chunks, pipe.scheduler_config.num_train_timesteps) if chunks.stages > 1 else ([], [])
    dtype = np.float32 if pipe.manifest.dtype == "fp32" else ml_dtypes.bfloat16
    at = 0
    for st in range(chunks.stages):
        if st:
            o = 1 - ori[st]
            alpha = 1 / (math.sqrt(1 + 1 / chunks.gamma) * (1 - o) + o)
            beta = alpha * (1 - o) / math.sqrt(chunks.gamma)
            # as diffusers: the block noise in the model dtype, then alpha x + beta noise in float32
            x = (alpha * upsample(x) + beta * draws[st - 1].astype(dtype).astype(np.float32)).astype(np.float32)
        n = run.stages.count(st)
        x = denoise_chunk(pipe, g, run.programs[at:at + n], run.plans[st], kv, guidance, x, history,
                          run.modes[at:at + n], start=x if chunks.distilled else None,
                          on_step=lambda i, at=at: on_step(at + i),
                          on_preview=on_preview if st == chunks.stages - 1 else None)
        at += n
    return x


def _start(pipe: Pipeline, g: mf.Geometry, chunks: mf.Chunks, pil: Any, source: list[Any] | None, add_image: bool,
           add_video: bool, image_range: tuple[float, float], video_range: tuple[float, float], key: jax.Array
           ) -> tuple[np.ndarray | None, np.ndarray]:
    """(prefix, history): the first frame's latent (None for text-to-video: the first chunk makes it) and the clean
    latents before the first chunk (B, z, >= sum(history_sizes), h, w), zeros where there are none, as HeliosPipeline
    prepares them from an image or a source video."""
    b = g.batch
    depth = sum(chunks.history_sizes)
    history = np.zeros((*g.latent_shape[:2], depth, *g.latent_shape[3:]), np.float32)
    keys = iter(jax.random.split(key, 8))
    if pil is not None:
        px = images.vae_pixels(pil, g.width, g.height)
        prefix = pipe.encode_video(px[None], g)
        fake = pipe.encode_video(np.repeat(px[None], g.frames, axis=0), g)[:, :, -1:]  # a still chunk's last latent
        if add_image:
            prefix = _renoise(prefix, _uniform(next(keys), 1, *image_range)[0], next(keys))
            fake = _renoise(fake, _uniform(next(keys), 1, *video_range)[0], next(keys))
        history[:, :, -1:] = np.repeat(fake, b, axis=0)
        return np.repeat(prefix, b, axis=0), history
    if source is not None:
        window, cf = g.frames, g.latent_frames
        px = video_input.video_pixels(source, g.width, g.height)
        whole = len(source) // window
        start = len(source) - whole * window
        prefix = pipe.encode_video(px[:1], g)
        latents = np.concatenate([pipe.encode_video(px[start + i * window:start + (i + 1) * window], g)
                                  for i in range(whole)], axis=2)
        if add_video:
            prefix = _renoise(prefix, _uniform(next(keys), 1, *image_range)[0], next(keys))
            k_sigma, k_noise = next(keys), next(keys)
            sig = np.concatenate([_uniform(jax.random.fold_in(k_sigma, i), cf, *video_range) for i in range(whole)])
            latents = _renoise(latents, sig[None, None, :, None, None], k_noise)
        latents = np.repeat(latents, b, axis=0)
        if latents.shape[2] < depth:
            history = np.concatenate([history[:, :, :depth - latents.shape[2]], latents], axis=2)
        else:
            history = latents
        return np.repeat(prefix, b, axis=0), history
    return None, history


def denoise_chunk(pipe: Pipeline, g: mf.Geometry, programs: list[str], sched: scheduler.Plan, kv: Any,
                  guidance: float, x0: np.ndarray, history: np.ndarray, modes: Sequence[int] | None = None,
                  start: np.ndarray | None = None, on_step: Callable[[int], None] | None = None,
                  on_preview: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """One schedule's steps (a chunk's, or a pyramid stage's) from `x0` (B, z, C, h, w), the DiT seeing `history`
    (B, z, 1 + sum(history_sizes), H, W: [prefix, long, mid, short], full size), on the step runner
    (runtime/steps.py): the latents, float32. The sampler starts afresh (its history empty), as the pipelines'
    set_timesteps per chunk and stage; `start` (DMD) goes in the state's second row, where its rows keep it.
    `modes`: each step's guidance mode (0: CFG)."""
    state = runner.initial_state(x0, scheduler.state_rows(pipe.scheduler_config.solver_order), start)

    def per_step(i: int) -> dict[str, Any]:
        return {"kv": kv, "guidance": np.float32(guidance), "row": sched.coeffs[i],
                "cfg_mode": np.float32(modes[i] if modes is not None else 0)}

    state_dev = runner.run(pipe.bundle, g, programs, state, list(sched.timesteps[:len(programs)]), per_step,
                           fixed={"history": np.asarray(history, np.float32)},
                           where=lambda i: f"step {i + 1} of {len(programs)}", on_step=on_step,
                           on_preview=on_preview)
    return fetch(state_dev)[0].astype(np.float32)
