"""The one-segment loop: encode -> denoise -> decode of one bundle shape, what every kind without a loop of its own
runs (kinds.Kind.loop "segment"), and what Wan-Animate's segments and ChronoEdit's temporal reasoning run per part.

Its steps run on the one step runner (runtime/steps.py); what this loop supplies is its own: the prompt's keys and
values per expert, the guidance per expert, the sampler's rows, a flow-map model's target timesteps, and the
conditioning placed once. It takes the Pipeline front (runtime/pipeline.py) as `pipe` and calls its public methods;
it imports no loop and not the front."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import conditioning, kinds, samplers, scheduler
from . import manifest as mf
from . import steps as runner
from .distributed import fetch, put
from .errors import UserError
from .magcache import MagCache
from .settings import DenoiseSettings

Pipeline = Any  # the front (runtime/pipeline.py), which imports this loop: the loop calls its public methods


def denoise(pipe: Pipeline, embeds: dict[str, np.ndarray], s: DenoiseSettings, latents: np.ndarray | None = None,
            progress: bool = True, on_step: Callable[[int], None] | None = None, magcache: MagCache | None = None,
            size: Any = None, frames: int | None = None, conditioning_scale: Any = None,
            strength: float | None = None, noise: np.ndarray | None = None,
            on_preview: Callable[[np.ndarray], None] | None = None, calibration: list[float] | None = None,
            stop_after: int | None = None, resume: tuple[int, np.ndarray] | None = None) -> np.ndarray:
    """The denoising loop of one shape with settings `s` (Pipeline.denoise's, resolved): float32 latents
    (B, z, T, H/s, W/s), or with `stop_after` n, the whole scheduler state after step n.

    `resume` (step i, state): run steps i.. of this schedule from that whole scheduler state (what `stop_after`
    returns, possibly of another shape's run: runtime/chronoedit.py's temporal reasoning goes on from K steps over N
    frames with the state's rows cut to 2 latent frames, as diffusers trims UniPC's history). `calibration`: MagCache's
    ratios are appended to it (Pipeline.calibrate)."""
    if magcache is not None and not isinstance(magcache, MagCache):
        raise UserError("magcache must be a runtime.MagCache (e.g. MagCache(ratios=[...]))")
    g = pipe.denoise_shape(embeds, latents, size, frames)
    start = start_step(embeds, s, strength)
    if noise is not None and "video_latents" not in embeds:
        raise UserError("noise is for video-to-video (a video given to encode): other runs take `latents`")
    for key in ("prompt_embeds", "negative_prompt_embeds"):
        if key not in embeds:
            raise UserError(f"embeds has no {key!r}")
        if tuple(np.shape(embeds[key])) != g.embeds_shape:
            raise UserError(f"{key} has shape {list(np.shape(embeds[key]))}, "
                            f"this bundle needs {list(g.embeds_shape)}")
    extras = pipe.conditioning_inputs(embeds, g, conditioning_scale)
    plan = s.plan(pipe.scheduler_config, start)
    begin, resumed = (0, None) if resume is None else (int(resume[0]), np.asarray(resume[1], np.float32))
    if resumed is not None:
        want = (scheduler.state_rows(pipe.scheduler_config.solver_order), *g.latent_shape)
        if latents is not None or not 0 < begin < len(plan.timesteps) or resumed.shape != want:
            raise ValueError(f"resume takes a step in 1..{len(plan.timesteps) - 1} and a state of shape "
                             f"{list(want)}, without latents")
        latents = resumed[0]
    if latents is None and "video_latents" in embeds:  # video-to-video: the video's latents, noised
        latents = conditioning.noised(_video_latents(embeds, g), _noise(pipe, noise, s.seed, g), float(plan.sigmas[0]))
    if latents is None:
        latents = pipe.initial_latents(s.seed, g)
    latents = np.asarray(latents, np.float32)
    if not np.isfinite(latents).all():
        raise UserError("initial latents contain NaN or inf")

    count = len(plan.timesteps)
    experts = [pipe.expert_of(float(t)) for t in plan.timesteps[:count]]
    programs = runner.step_programs(pipe.manifest, pipe.kind, g, experts, s.guidance_of, magcache)
    cast = runner.timestep_cast(pipe.manifest, programs[0], plan.timesteps, s.sampler)
    if resumed is not None:
        state = resumed
    else:
        state = runner.initial_state(latents, scheduler.state_rows(pipe.scheduler_config.solver_order))
    prompt = np.asarray(embeds["prompt_embeds"], np.float32)
    contexts = {True: np.concatenate([prompt, embeds["negative_prompt_embeds"]]).astype(np.float32), False: prompt}
    with_kv = pipe.precomputes_kv()
    rows = pipe.text_rows(contexts[True], programs) if with_kv else None
    step_extras = [n for n in (pipe.kind.conditioning_inputs if with_kv else pipe.kind.denoise_extras)
                   if n not in kinds.STEP_INPUTS]
    r_timesteps = _r_timesteps(plan, s, extras, cast) if pipe.kind.flow_map else None
    guidances = [np.float32(s.guidance_of(e)) for e in range(2)]
    texts: dict[Any, Any] = {}  # context by cfg (older bundles), or keys and values by expert, placed once each

    def per_step(i: int) -> dict[str, Any]:
        e = experts[i]
        cfg = kinds.denoise_variant(programs[i]).cfg
        text = ("kv", e) if with_kv else cfg
        if text not in texts:
            if with_kv:  # once per prompt and expert: every step's cross-attention keys and values
                texts[text] = pipe.prompt_kv(contexts[True], e, rows, extras)
            else:
                texts[text] = put(contexts[cfg], pipe.bundle.input_shardings(programs[i])[1])
        return {"kv": texts[text], "context": texts[text], "guidance": guidances[e], "row": plan.coeffs[i],
                "r_timestep": None if r_timesteps is None else r_timesteps[i]}

    bar = runner.progress_bar(count, progress, initial=begin)
    try:
        state_dev = runner.run(pipe.bundle, g, programs, state, plan.timesteps, per_step,
                              fixed={n: extras[n] for n in step_extras}, cast=cast, begin=begin,
                              where=lambda i: f"denoising step {i + 1} of {count}", on_step=on_step,
                              on_preview=on_preview, bar=bar, experts=experts, calibration=calibration,
                              stop_after=stop_after)
    finally:
        bar.close()
    if stop_after is not None:
        return fetch(state_dev).astype(np.float32)  # every row of the scheduler's state
    out = fetch(state_dev)[0].astype(np.float32)
    return conditioning.after_loop(pipe.kind, extras, out, g)


def calibrate(pipe: Pipeline, embeds: dict[str, np.ndarray], s: DenoiseSettings, latents: np.ndarray | None = None,
              progress: bool = True, size: Any = None, frames: int | None = None,
              conditioning_scale: Any = None) -> list[float]:
    """MagCache's ratios for this bundle and settings `s`, as diffusers' calibration mode computes them: every step
    runs in full; step i's ratio is the mean over tokens of |residual_i| / |residual_i-1| on the prompt (cond) half,
    1.0 on each expert's first step."""
    ratios: list[float] = []
    everything = MagCache([1.0], threshold=0.0, max_skip_steps=0, retention_ratio=1.0)  # never skips
    denoise(pipe, embeds, s, latents, progress, magcache=everything, calibration=ratios, size=size, frames=frames,
            conditioning_scale=conditioning_scale)
    return ratios


def first_velocity(pipe: Pipeline, embeds: dict[str, np.ndarray], s: DenoiseSettings,
                   latents: np.ndarray | None = None, size: Any = None, frames: int | None = None) -> np.ndarray:
    """The guided velocity the DiT predicts at the first step (B, z, T, H/s, W/s), from the one step that runs: the
    scheduler keeps the converted model output m_0 = x_0 - sigma_0 v_0 (runtime/scheduler.py)."""
    g = pipe.denoise_shape(embeds, latents, size, frames)
    x0 = np.asarray(pipe.initial_latents(s.seed, g) if latents is None else latents, np.float32)
    state = denoise(pipe, embeds, s, x0, False, size=size, frames=frames, stop_after=1)
    sigma0 = float(s.plan(pipe.scheduler_config).coeffs[0][0])
    return (x0 - state[2]) / sigma0


def _r_timesteps(plan: scheduler.Plan, s: DenoiseSettings, extras: dict[str, np.ndarray],
                 timestep_of: runner.Cast) -> list[np.ndarray]:
    """A flow-map model's target timestep of each frame at each step (T,): the next sigma x 1000 (the mean velocity's
    r; 0 after the last step), or with sampler euler the frame's own timestep (AnyFlowPipeline's
    use_mean_velocity=False, whose r_timestep is its timestep tensor, zeroed on the given frames with it)."""
    denoised = extras["mask"][0, 0, :, 0, 0]  # 1 on the frames made, 0 on a given video's
    ts = [float(t) for t in plan.timesteps]
    out = []
    for i, t in enumerate(ts):
        r = (ts[i + 1] if i + 1 < len(ts) else 0.0) if s.mean_velocity else None
        out.append(np.asarray([timestep_of(t * m if r is None else r) for m in denoised], np.float32))
    return out


def start_step(embeds: dict[str, Any], s: DenoiseSettings, strength: float | None) -> int:
    """The first of the schedule's steps a run takes: 0, or for video-to-video (embeds with `video_latents`) the one
    `strength` picks (samplers.start_step: at least the last step runs); UserError for a bad strength."""
    if "video_latents" not in embeds:
        if strength is not None:
            raise UserError("strength is for video-to-video: a source video given to a bundle exported with "
                            "--video-to-video")
        return 0
    strength = 0.8 if strength is None else strength
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 < strength <= 1:
        raise UserError(f"strength must be a number in (0, 1], got {strength!r}")
    return samplers.start_step(s.steps, strength)


def steps_run(pipe: Pipeline, embeds: dict[str, Any], s: DenoiseSettings, strength: float | None = None) -> int:
    """The denoising steps a run of `s` takes: the schedule's from start_step on (video-to-video runs only the last
    ones), what progress counts."""
    return len(s.plan(pipe.scheduler_config, start_step(embeds, s, strength)).timesteps)


def _video_latents(embeds: dict[str, Any], g: mf.Geometry) -> np.ndarray:
    value = np.asarray(embeds["video_latents"], np.float32)
    if value.shape != g.latent_shape:
        raise UserError(f"video_latents has shape {list(value.shape)}, this shape needs {list(g.latent_shape)}")
    return value


def _noise(pipe: Pipeline, noise: np.ndarray | None, seed: int, g: mf.Geometry) -> np.ndarray:
    if noise is None:
        return pipe.initial_latents(seed, g)
    noise = np.asarray(noise, np.float32)
    if noise.shape != g.latent_shape or not np.isfinite(noise).all():
        raise UserError(f"noise must be finite, of shape {list(g.latent_shape)} (got {list(noise.shape)})")
    return noise


def generate(pipe: Pipeline, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
             image: Any = None, last_image: Any = None, seed: int = 0, steps: int | None = None,
             guidance: float | None = None, guidance_2: float | None = None, flow_shift: float | None = None,
             latents: np.ndarray | None = None, progress: bool = True, magcache: MagCache | None = None,
             low_memory: bool = False, size: Any = None, frames: int | None = None, sampler: str | None = None,
             sigmas: Sequence[float] | None = None, video: Any = None, mask: Any = None,
             reference_images: Sequence[Any] | None = None, conditioning_scale: Any = None,
             strength: float | None = None, noise: np.ndarray | None = None,
             on_step: Callable[[int, int], None] | None = None,
             on_preview: Callable[[np.ndarray], None] | None = None, decoder: str = "full",
             on_frames: Callable[[np.ndarray], None] | None = None,
             use_mean_velocity: bool | None = None) -> np.ndarray:
    """prompt (+ image or video) -> frames (B, F, H, W, 3) float32 in [0, 1], one bundle shape, one segment
    (Pipeline.generate documents the keywords)."""
    pipe.prompts(prompt, "prompt")  # an empty one fails before any loading starts
    pipe.decoder_programs(decoder)  # as does a decoder the bundle lacks
    if use_mean_velocity is not None:
        sampler = samplers.mean_velocity_sampler(use_mean_velocity, sampler, pipe.kind.flow_map)
    pipe.check_videos(video, mask, reference_images)
    media = pipe.load_videos(video, mask, reference_images)
    g = pipe.denoise_shape({}, latents, size, frames) if latents is not None else \
        pipe.shape_for_videos(size, frames, *((media["video"], media["references"]) if media else ()))
    size, frames = g.size, g.frames
    s = pipe.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
    pipe.start_loading(s, g, image=image is not None or media is not None, magcache=magcache, prompt=prompt,
                       negative_prompt=negative_prompt)
    try:
        embeds = pipe.encode(prompt, negative_prompt, image, last_image, size, frames,
                             **({} if media is None else {"video": media["video"], "mask": media["mask"],
                                                          "reference_images": media["references"]}))
        if low_memory:
            pipe.unload_before("denoise")
        step_done = None
        if on_step is not None:
            total = steps_run(pipe, embeds, s, strength)

            def step_done(i: int) -> None:
                on_step(i + 1, total)
        out = denoise(pipe, embeds, s, latents, progress, on_step=step_done, magcache=magcache, size=size,
                      frames=frames, conditioning_scale=conditioning_scale, strength=strength, noise=noise,
                      on_preview=on_preview)
        if low_memory:
            pipe.unload_before("decode")
        frames_ = pipe.decode(out, decoder)
        if on_frames is not None:
            on_frames(frames_)
        return frames_
    except BaseException:
        pipe.bundle.cancel_prefetch()
        raise
