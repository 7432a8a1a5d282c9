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

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from . import images, previews, samplers, scheduler, video_input
from . import manifest as mf
from .distributed import fetch, is_primary, put
from .errors import UserError
from .forcing import InputError
from .noise import seed_noise, segment_noise

if TYPE_CHECKING:
    from .pipeline import Pipeline

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
    out = scheduler.Plan(timesteps=timesteps.astype(np.float32), sigmas=sig.astype(np.float32),
                         coeffs=rows.astype(np.float32))
    for a in (out.timesteps, out.sigmas, out.coeffs):
        a.setflags(write=False)
    return out


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
             sigmas: Sequence[float] | None = None, latents: Any = None,
             add_noise_to_image_latents: bool | None = None, image_noise_sigma_min: float | None = None,
             image_noise_sigma_max: float | None = None, add_noise_to_video_latents: bool | None = None,
             video_noise_sigma_min: float | None = None, video_noise_sigma_max: float | None = None,
             is_skip_first_chunk: bool | None = None, progress: bool = True, size: Any = None,
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
    is_skip_first_chunk. `latents`: one initial noise per chunk (B, z, C, h, w), or the first chunk's. `on_step(done,
    total)` after every step of every chunk (it may raise to stop the run), `on_preview(rgb)` with each step's
    estimate of the chunk's middle frame, `on_frames(frames)` with each chunk's frames as soon as it is decoded.
    The rest as Pipeline.generate; `sampler` is "unipc" or "euler" (HeliosScheduler's), `sigmas` one per step before
    the shift. flow_shift, guidance_2 and MagCache have no meaning here (the shift is computed per chunk) and are
    refused; `low_memory` changes nothing (each chunk is decoded as it is made); `fps` is the mp4's only."""
    if magcache is not None:
        raise UserError("MagCache is not for Helios: leave magcache out")
    if flow_shift is not None:
        raise InputError("flow_shift is not a Helios setting: its scheduler shifts each chunk's sigmas by the chunk's "
                         "token count (the bundle's use_dynamic_shifting); leave flow_shift out", "flow_shift")
    if guidance_2 is not None:
        raise InputError("guidance_2 is for two-expert models; Helios has one transformer", "guidance_2")
    chunks = pipe.manifest.chunks
    if chunks is None:
        raise UserError("this bundle has no Helios chunk settings (manifest `chunks`): re-export it")
    pipe._prompts(prompt, "prompt")
    pipe.decoder_programs(decoder)  # a decoder the bundle lacks fails before any work
    if num_frames is None and frames is not None:  # as the CLI's --frames: the video's length
        num_frames, frames = frames, None
    if video is not None and image is not None:
        raise InputError("give an image (image-to-video) or a video to continue, not both", "image")
    g = pipe.shape(size, frames)
    window, cf = g.frames, g.latent_frames
    n = window if num_frames is None else num_frames
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise InputError(f"num_frames must be an integer >= 1, got {n!r}", "num_frames")
    count = chunk_count(int(n), window)
    add_image = True if add_noise_to_image_latents is None else bool(add_noise_to_image_latents)
    add_video = True if add_noise_to_video_latents is None else bool(add_noise_to_video_latents)
    image_range = _noise_range(*(NOISE_RANGE[i] if v is None else v for i, v in
                                 enumerate((image_noise_sigma_min, image_noise_sigma_max))), "image")
    video_range = _noise_range(*(NOISE_RANGE[i] if v is None else v for i, v in
                                 enumerate((video_noise_sigma_min, video_noise_sigma_max))), "video")
    source = None if video is None else video_input.load_frames(video, "video")
    if source is not None and len(source) < window:
        raise InputError(f"the video has {len(source)} frame{'s' * (len(source) != 1)}, fewer than one chunk of "
                         f"{window}: Helios continues a video from its last whole chunks of {window} frames",
                         "video")
    pil = None if image is None else images.load_image(image, "image")
    s = pipe.settings(seed, steps, guidance, None, None, sampler, sigmas)
    if s.sampler not in SAMPLERS:
        raise InputError(f"sampler {s.sampler} is not one of Helios' ({', '.join(SAMPLERS)})", "sampler")
    patch = int(np.prod(chunks.patch_size))
    sched = plan(s.sampler, s.steps, chunks, pipe.scheduler_config, cf * g.latent_height * g.latent_width // patch,
                 s.sigmas)
    noise = segment_noise(latents, count, g.latent_shape)
    programs = pipe.step_programs(s.steps, sched.timesteps, s, None, g)
    total = count * s.steps

    pipe.start_loading(pil is not None or source is not None, s.seed, s.steps, s.guidance, None, None, None, prompt,
                       negative_prompt, g.size, g.frames, s.sampler, s.sigmas)
    bar = tqdm(total=total, desc="denoising", unit="step", disable=not progress or not is_primary())
    try:
        embeds = pipe.encode(prompt, negative_prompt, size=g.size, frames=g.frames)
        key = jax.random.fold_in(jax.random.key(s.seed), 0x4E110)
        prefix, history = _start(pipe, g, chunks, pil, source, add_image, add_video, image_range, video_range, key)
        context = np.concatenate([embeds["prompt_embeds"], embeds["negative_prompt_embeds"]]).astype(np.float32)
        kv = pipe.prompt_kv(context, 0, pipe.text_rows(context, programs))
        keep = output_frames(count, window, g.temporal_scale)
        parts: list[np.ndarray] = []
        made = 0
        for k in range(count):
            x0 = noise[k] if noise[k] is not None else seed_noise(s.seed, k, g.latent_shape)
            first = prefix if prefix is not None else np.zeros((*g.latent_shape[:2], 1, *g.latent_shape[3:]),
                                                               np.float32)
            hist = np.concatenate([first, history[:, :, -sum(chunks.history_sizes):]], axis=2)

            def step_done(i: int, k: int = k) -> None:
                bar.update(1)
                if on_step is not None:
                    on_step(k * s.steps + i + 1, total)

            out = denoise_chunk(pipe, g, programs, sched, kv, s.guidance, np.asarray(x0, np.float32), hist,
                                step_done, on_preview)
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
                  guidance: float, x0: np.ndarray, history: np.ndarray, on_step: Callable[[int], None] | None = None,
                  on_preview: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """One chunk's steps from its noise `x0` (B, z, C, h, w), the DiT seeing `history` (B, z, 1 + sum(history_sizes),
    h, w: [prefix, long, mid, short]): the chunk's clean latents, float32. The sampler starts afresh (its history
    empty), as HeliosPipeline's set_timesteps per chunk."""
    order = pipe.scheduler_config.solver_order
    state = np.zeros((scheduler.state_rows(order), *x0.shape), np.float32)
    state[0] = x0
    names = pipe.program_inputs(programs[0])
    placed = dict(zip(names, pipe.bundle.call_shardings(programs[0]), strict=True))
    state_dev = put(state, placed["state"])
    hist_dev = put(np.ascontiguousarray(history, np.float32), placed["history"])
    preview = previews.Previewer(g) if on_preview is not None and previews.family(g.latent_channels) else None
    for i, name in enumerate(programs):
        values = {"state": state_dev, "kv": kv, "timestep": np.float32(sched.timesteps[i]),
                  "guidance": np.float32(guidance), "row": sched.coeffs[i], "history": hist_dev}
        state_dev, finite = pipe.bundle.call(name)(*[values[n] for n in pipe.program_inputs(name)])
        if not bool(fetch(finite)):
            raise UserError(f"non-finite values (NaN/inf) appeared in the latents at step {i + 1} of {len(programs)}: "
                            f"check the weights, guidance ({guidance}) and dtype")
        if preview is not None:
            on_preview(preview(state_dev))  # type: ignore[misc]
        if on_step is not None:
            on_step(i)
    return fetch(state_dev)[0].astype(np.float32)
