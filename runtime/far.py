"""AnyFlow-FAR's chunk loop (kinds.py "far"): AnyFlowFARPipeline's causal chunks with their KV cache, on the one step
runner (runtime/steps.py).

The video's latent frames are cut into chunks (runtime/far_layout.py). Chunk k is denoised by the flow-map sampler
(steps 1-16; `use_mean_velocity` False is sampler euler), each step one call of the bundle's step program, which
attends to the chunk and to the KV cache. Before chunk k (k > 0) the cache write program re-encodes the clean video
made so far (chunks 0..k-1) under the prompt in force: diffusers writes it after each chunk, the same computation,
so the video is the same; written just before the chunk that reads it, a prompt changed between chunks is LongLive's
KV re-cache for free (the cache rebuilt under the new prompt from the frames already made: the video is
AnyFlowFARPipeline's run with the new prompt and `video_latents` the latents made before chunk k, the same initial
latents; frames before k unchanged).

Context: `image` is the first chunk's (one latent frame), `video` (4k + 1 frames) fills the first latent frames; the
chunks they cover only write the cache, and a covering chunk's frames past the context stay zero (as diffusers).

Two ways in, the same loop:
- `generate(pipe, prompt, ..., prompt_changes={chunk: prompt})`: the whole video (Pipeline.generate for this kind);
- `stream(pipe, prompt, ...)`: a `Session`, an iterator of `Chunk`s (each chunk's frames, decoded as made: the VAE's
  causal caches carried, so the frames joined are the whole video's), whose `prompt` may be set between chunks
  (`session.prompt = "..."`, or `session.send("...")` on the generator protocol): it applies from the next chunk not
  yet started. The session holds the cache on the devices until it ends.

It takes the Pipeline front (runtime/pipeline.py) as `pipe` and calls its public methods; it imports no loop and not
the front."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import images, samplers, scheduler, video_input
from . import steps as runner
from .distributed import fetch
from .errors import UserError
from .far_layout import Layout

Pipeline = Any  # the front (runtime/pipeline.py), which imports this loop: the loop calls its public methods


@dataclass
class Chunk:
    """One chunk as made: its index, its latent frames (B, z, f, h, w), its video frames (B, F, H, W, 3) float32 in
    [0, 1] (None until decoded), the prompt it was made under, and whether it was given (context) or made."""

    index: int
    latents: np.ndarray
    frames: np.ndarray | None
    prompt: str
    context: bool


class Session:
    """A FAR run chunk by chunk (`stream`): iterate it for `Chunk`s; set `prompt` between chunks."""

    def __init__(self, pipe: Pipeline, prompt: str, negative_prompt: str = "", image: Any = None, video: Any = None,
                 seed: int = 0, steps: int | None = None, guidance: float | None = None,
                 flow_shift: float | None = None, sampler: str | None = None, sigmas: Sequence[float] | None = None,
                 latents: np.ndarray | None = None, use_mean_velocity: bool | None = None, size: Any = None,
                 frames: int | None = None, decode: bool = True, decoder: str = "full", progress: bool = False,
                 on_step: Callable[[int, int], None] | None = None) -> None:
        if not pipe.kind.far:
            raise UserError(f"this bundle is {pipe.kind.title}: chunk streaming is for AnyFlow-FAR bundles")
        if use_mean_velocity is not None:
            sampler = samplers.mean_velocity_sampler(use_mean_velocity, sampler, True)
        if image is not None and video is not None:
            raise UserError("give an image or a video as context, not both")
        pipe.prompts(prompt, "prompt")
        self.pipe = pipe
        self.g = pipe.shape(size, frames) if latents is None else pipe.shape_of_latents(np.shape(latents))
        g = self.g
        self.layout = Layout.of(g.latent_frames, pipe.manifest.source["config"]["transformer"])
        self.s = pipe.settings(seed, steps, guidance, flow_shift, None, sampler, sigmas)
        self.decoder = pipe.frame_decoder(decoder) if decode else None
        self.negative = negative_prompt
        self.prompt = prompt
        self._kv: tuple[str, Any] | None = None
        x0 = pipe.initial_latents(self.s.seed, g) if latents is None else np.asarray(latents, np.float32)
        if x0.shape != g.latent_shape or not np.isfinite(x0).all():
            raise UserError(f"latents must be finite, of shape {list(g.latent_shape)}")
        self.x0 = x0
        self.output = np.zeros(g.latent_shape, np.float32)
        given = self._context(image, video)
        self.context = self.layout.context_chunks(given.shape[2]) if given is not None else 0
        if given is not None:
            self.output[:, :, :given.shape[2]] = given
        self.step_name = runner.step_program(pipe.manifest, g, 0, self.s.guidance)
        self.cache_name = pipe.program_name("cache_step" + ("_cond" if self.step_name.startswith(
            "denoise_step_cond") else ""), g)
        self.plan = self.s.plan(pipe.scheduler_config)
        self.cast = runner.timestep_cast(pipe.manifest, self.step_name, self.plan.timesteps, self.s.sampler)
        self.caches = self._empty_caches()
        self.progress, self.on_step = progress, on_step
        self.made = 0
        self.total = (self.layout.chunks - self.context) * len(self.plan.timesteps)
        self._next = 0

    # -- inputs ---------------------------------------------------------------------------------------------------
    def _context(self, image: Any, video: Any) -> np.ndarray | None:
        """The context's latents (B, z, T', h, w): the image as a one-frame video, or the video's (4k + 1 frames)."""
        if image is None and video is None:
            return None
        g = self.g
        pil = [images.load_image(image, "image")] if image is not None else video_input.load_frames(video)
        n = len(pil)
        if (n - 1) % g.temporal_scale or n >= g.frames:
            raise UserError(f"the video has {n} frames: give the first frames to continue, 4k+1 of them, fewer than "
                            f"the {g.frames} the run makes")
        latents = self.pipe.encode_video(video_input.video_pixels(pil, g.width, g.height), g)
        return np.broadcast_to(latents, (g.batch, *latents.shape[1:])).astype(np.float32)

    def _empty_caches(self) -> list[Any]:
        """The KV cache, zeros on the devices, laid out as the step program takes it."""
        bundle = self.pipe.bundle
        spec = self.pipe.manifest.programs[self.step_name]
        names = runner.signature_of(bundle, self.step_name)
        shardings = dict(zip(names, bundle.call_shardings(self.step_name), strict=True))
        out = []
        for n in ("full_cache", "compressed_cache"):
            t = spec.inputs[n]
            out.append(jax.jit(lambda t=t: jnp.zeros(t.shape, jnp.dtype(t.dtype)), out_shardings=shardings[n])())
        return out

    def _prompt_kv(self) -> Any:
        """The current prompt's cross-attention keys and values (computed once per prompt)."""
        if self._kv is None or self._kv[0] != self.prompt:
            embeds = self.pipe.encode(self.prompt, self.negative)
            context = np.concatenate([embeds["prompt_embeds"], embeds["negative_prompt_embeds"]]).astype(np.float32)
            self._kv = (self.prompt, self.pipe.prompt_kv(context, 0, None))
        return self._kv[1]

    # -- the loop -------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        k = self._next
        if k >= self.layout.chunks:
            raise StopIteration
        self._next += 1
        lay = self.layout
        if k >= self.context:
            if k > 0:
                self._write(k - 1)
            self.output[:, :, lay.frames(k)] = self._denoise(k)
        latents = self.output[:, :, lay.frames(k)]
        frames = self.decoder(latents) if self.decoder is not None else None
        return Chunk(k, latents, frames, self.prompt, k < self.context)

    def send(self, prompt: str | None) -> Chunk:
        """Set the prompt (None: keep it) for the chunks not yet started, then make the next one."""
        if prompt is not None:
            self.pipe.prompts(prompt, "prompt")
            self.prompt = prompt
        return next(self)

    def _write(self, k: int) -> None:
        """The cache write after chunk k (AnyFlowFARPipeline.encode_kv_cache) under the current prompt."""
        pos, chunk = self.layout.cache_slots(k)
        call = self.pipe.bundle.call(self.cache_name)
        self.caches = list(call(self.layout.cache_latents(self.output, k), pos, chunk, self._prompt_kv(),
                                *self.caches))

    def _denoise(self, k: int) -> np.ndarray:
        """Chunk k's latents (B, z, partition[k], h, w) after the run's steps."""
        lay, plan = self.layout, self.plan
        x = np.zeros((*self.x0.shape[:2], lay.chunk, *self.x0.shape[3:]), np.float32)
        x[:, :, :lay.partition[k]] = self.x0[:, :, lay.frames(k)]
        count = len(plan.timesteps)
        ts = [float(t) for t in plan.timesteps]
        rs = [np.float32(self.cast((ts[i + 1] if i + 1 < count else 0.0) if self.s.mean_velocity else ts[i]))
              for i in range(count)]
        kv, pos, guidance = self._prompt_kv(), lay.step_positions(k), np.float32(self.s.guidance)

        def per_step(i: int) -> dict[str, Any]:
            return {"kv": kv, "guidance": guidance, "row": plan.coeffs[i], "r_timestep": rs[i],
                    "full_cache": self.caches[0], "compressed_cache": self.caches[1], "frame_pos": pos}

        def done(i: int) -> None:
            self.made += 1
            if self.on_step is not None:
                self.on_step(self.made, self.total)

        state = runner.initial_state(x, scheduler.state_rows(self.pipe.scheduler_config.solver_order))
        bar = runner.progress_bar(count, self.progress, desc=f"chunk {k + 1} of {lay.chunks}")
        try:
            out = runner.run(self.pipe.bundle, self.g, [self.step_name] * count, state, plan.timesteps, per_step,
                             where=lambda i: f"step {i + 1} of {count} of chunk {k + 1}", cast=self.cast,
                             on_step=done, bar=bar)
        finally:
            bar.close()
        return fetch(out)[0][:, :, :lay.partition[k]].astype(np.float32)


def stream(pipe: Pipeline, prompt: str, negative_prompt: str = "", **kw: Any) -> Session:
    """A FAR run as an iterator of its chunks (`Session`; the keywords as `generate`'s, less prompt_changes)."""
    return Session(pipe, prompt, negative_prompt, **kw)


def generate(pipe: Pipeline, prompt: str, negative_prompt: str = "", image: Any = None, video: Any = None,
             seed: int = 0, steps: int | None = None, guidance: float | None = None, flow_shift: float | None = None,
             sampler: str | None = None, sigmas: Sequence[float] | None = None, latents: np.ndarray | None = None,
             use_mean_velocity: bool | None = None, prompt_changes: dict[int, str] | None = None,
             progress: bool = True, size: Any = None, frames: int | None = None,
             on_step: Callable[[int, int], None] | None = None, decoder: str = "full",
             on_frames: Callable[[np.ndarray], None] | None = None, low_memory: bool = False,
             **unused: Any) -> np.ndarray:
    """frames (B, F, H, W, 3) float32 in [0, 1]: the whole video, chunk by chunk. `prompt_changes` {chunk: prompt}:
    from that chunk on, that prompt (the cache re-encoded under it first). `on_frames` gets each chunk's frames as it
    is made (decoded with the VAE's caches carried, so they join into the video's frames, which are returned: the
    video is decoded once). The rest as
    Pipeline.generate; `latents` the whole video's initial noise (B, z, T, h, w)."""
    given = sorted(k for k, v in unused.items() if v is not None and v is not False)
    if given:
        raise UserError(f"this bundle is {pipe.kind.title}: it takes no {given[0].replace('_', ' ')}")
    changes = dict(prompt_changes or {})
    session = Session(pipe, prompt, negative_prompt, image=image, video=video, seed=seed, steps=steps,
                      guidance=guidance, flow_shift=flow_shift, sampler=sampler, sigmas=sigmas, latents=latents,
                      use_mean_velocity=use_mean_velocity, size=size, frames=frames, decode=on_frames is not None,
                      decoder=decoder, progress=progress, on_step=on_step)
    for k in changes:
        if not isinstance(k, int) or not 0 < k < session.layout.chunks:
            raise UserError(f"prompt_changes' chunks are 1..{session.layout.chunks - 1}, not {k!r}")
        pipe.prompts(changes[k], "prompt")
    made = []
    for k in range(session.layout.chunks):
        chunk = session.send(changes.get(k))
        if on_frames is not None and chunk.frames is not None:
            on_frames(chunk.frames)
            made.append(chunk.frames)
    if made:  # decoded as they came (the VAE's caches carried): the whole video's frames
        return np.concatenate(made, axis=1)
    if low_memory:
        pipe.unload_before("decode")
    return pipe.decode(session.output, decoder)
