"""`runtime.load(path)` -> `Pipeline`: a loaded bundle, the one front every interface (the CLI, the server, Python)
runs.

The front is thin: each concern lives in its own module, and the methods here hand over to it with the bundle's
manifest, kind and programs:

- which shape a run makes: runtime/shapes.py (pure functions of the manifest);
- prompts, tokens and the text programs they run: runtime/text.py; images and videos: runtime/conditioning.py;
- the denoising loops: the one-segment loop (runtime/segment.py) and those of kinds with a loop of their own
  (kinds.Kind.loop: runtime/animate.py, forcing.py, helios.py, chronoedit.py), all on the one step runner
  (runtime/steps.py); `generate` picks the kind's loop;
- latents to frames: runtime/decoding.py.

The loops take this front as `pipe` and call its public methods; they import none of this module."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    adapters,
    animate,
    animate2,
    chronoedit,
    conditioning,
    decoding,
    far,
    forcing,
    front,
    helios,
    images,
    kinds,
    segment,
)
from . import manifest as mf
from . import settings as st
from . import shapes as sh
from . import steps as runner
from . import text as tx
from .bundle import Bundle, open_bundle
from .distributed import fetch
from .errors import UserError
from .kinds import Kind
from .magcache import MagCache
from .scheduler import UniPCConfig
from .settings import MAX_SEED, DenoiseSettings  # noqa: F401  (public names of this module)
from .shapes import Size, parse_size  # noqa: F401  (public names of this module)
from .text import PromptTokenizer

ImageInput = Any  # a PIL image, a path, or a uint8 (H, W, 3) array (runtime/images.py)
VideoInput = Any  # a path, a folder of images, PIL frames or an (F, H, W, 3) array (runtime/video_input.py)

# The loop `generate` runs, by kinds.Kind.loop: each takes this front and `generate`'s keywords.
LOOPS: dict[str, Callable[..., np.ndarray]] = {
    "segment": segment.generate,
    "animate": animate.generate,
    "forcing": forcing.generate,
    "helios": helios.generate,
    "chronoedit": chronoedit.generate,
    "far": far.generate,
    "animate-2": animate2.generate,
}


class Pipeline:
    """A loaded bundle. Programs and weights are loaded on first use of each stage.

    A bundle makes one or more shapes (width x height x frames, `shapes`; the first is the default): one copy of
    the weights, programs per shape. `generate`, `encode`, `denoise` and `calibrate` take `size=` and `frames=`
    (a shape the bundle lacks is a UserError listing those it has); `denoise` and `decode` take the shape of the
    latents they are given."""

    def __init__(self, bundle: Bundle, loras: Sequence[adapters.LoraSpec] | None = None,
                 named: dict[str, Any] | None = None) -> None:
        self.bundle = bundle
        self.manifest: mf.Manifest = bundle.manifest
        # LoRA adapters: those the pipeline was loaded with, and those it offers by name (runtime/adapters.py)
        self.base_loras: list[adapters.LoraSpec] = list(loras or [])
        self.loras: dict[str, Any] = dict(named or {})  # name -> runtime.lora.Adapter
        self.geometry = self.manifest.geometry  # the default shape
        self.kind: Kind = kinds.get(self.manifest.kind)
        self._tokenizer: PromptTokenizer | None = None
        self.scheduler_config = UniPCConfig.from_json(self.manifest.scheduler)

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    def use_loras(self, loras: Sequence[adapters.LoraSpec]) -> dict[str, Any] | None:
        """Make `loras` the LoRA set of the DiT's weights from now on: each (path or name, scale) or (path or name,
        scale, expert), a name one of `loras`' (the adapters of `lora_dir`), `expert` "high" or "low" on two-expert
        bundles (the adapter applied to that expert; default: the experts it was made for). `[]`: no adapter.

        Nothing happens when the set is the one the weights hold; otherwise the tensors either set changes are merged
        again from their unmodified weights (Bundle.set_loras), so the result equals a fresh `runtime.load(...,
        loras=...)` of the set, bit for bit, whatever ran before. Weights not loaded yet load with it. Returns what
        the switch did (its seconds, the tensors merged again), or None. UserError for a bad set, before any change."""
        resolved = adapters.resolve(loras, self.manifest, self.loras)
        key = adapters.key(resolved)
        if key == self.bundle.lora_key:
            return None
        switched = self.bundle.set_loras(adapters.updates(resolved, self.manifest), key)
        if switched is not None:
            switched["set"] = adapters.describe_set(resolved)
        return switched

    # -- shapes (runtime/shapes.py) ------------------------------------------------------------------------------
    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The (width, height, frames) this bundle makes, the default first."""
        return [g.shape for g in self.manifest.shapes]

    def shape(self, size: Size = None, frames: int | None = None, reference_images: int | None = None) -> mf.Geometry:
        """The bundle's shape of this size ("WxH" or (width, height)), frame count and count of reference images
        (VACE); what is None is the default shape's. UserError naming the bundle's shapes if it has none such."""
        return sh.shape(self.manifest, size, frames, reference_images)

    def shape_for_videos(self, size: Size = None, frames: int | None = None, video: Sequence[Any] | None = None,
                         reference_images: Sequence[Any] | None = None) -> mf.Geometry:
        """The shape a run with these video inputs makes (shapes.for_videos)."""
        return sh.for_videos(self.manifest, self.kind, size, frames, video, reference_images)

    def shape_of_latents(self, shape: tuple[int, ...], video: bool = False) -> mf.Geometry:
        """The bundle's shape whose denoised (`video`: decoded) latents have this shape (shapes.of_latents)."""
        return sh.of_latents(self.manifest, shape, video)

    def denoise_shape(self, embeds: dict[str, np.ndarray], latents: np.ndarray | None, size: Size = None,
                      frames: int | None = None) -> mf.Geometry:
        """The shape a denoising run makes (shapes.of_denoising)."""
        return sh.of_denoising(self.manifest, embeds, latents, size, frames)

    def decode_shape(self, shape: tuple[int, ...]) -> mf.Geometry:
        """The bundle shape whose decoder decodes video latents of `shape` (shapes.of_decoding)."""
        return sh.of_decoding(self.manifest, shape)

    # -- programs ------------------------------------------------------------------------------------------------
    def program_name(self, program: str, g: mf.Geometry) -> str:
        """The name of program `program` (as kinds names it) for shape `g`."""
        return self.manifest.program_for(program, g)

    def call(self, program: str, g: mf.Geometry) -> Callable[..., Any]:
        """Program `program` (as kinds names it) of shape `g`, compiled, its weights bound: fn(*inputs) in call
        order (runtime/signatures.py)."""
        return self.bundle.call(self.program_name(program, g))

    def program_inputs(self, program: str) -> tuple[str, ...]:
        """The names of program `program`'s inputs, in call order (runtime/signatures.py)."""
        return runner.signature_of(self.bundle, program)

    def prepare(self, magcache: bool = True) -> None:
        """Place every weight and compile every program of every shape (and the noise sampler) now, so the first
        job starts at once: what a server does before it reports ready. Without `magcache`, MagCache's step
        programs are left out (a server whose jobs never use them)."""
        names = [n for n in self.manifest.programs
                 if magcache or (v := kinds.denoise_variant(n)) is None or not v.residual]
        self.bundle.prefetch(names)
        for name in names:
            self.bundle.call(name)
            for part in self.manifest.programs[name].parts[1:]:  # a block loop's, for prompts of every length
                self.bundle.compiled_part(name, part)
        for g in self.manifest.shapes:
            self.initial_latents(0, g)

    # -- text, images and videos (runtime/text.py, runtime/conditioning.py) --------------------------------------
    def tokenizer(self) -> PromptTokenizer:
        if self._tokenizer is None:
            path = mf.resolve(self.bundle.path, self.manifest.tokenizer.file)
            self._tokenizer = PromptTokenizer.from_file(path, self.geometry.max_sequence_length)
        return self._tokenizer

    def prompts(self, prompt: str | Sequence[str], what: str = "prompt") -> list[str]:
        """The batch's prompts (text.prompt_rows): UserError for an empty prompt or a list of the wrong length."""
        return tx.prompt_rows(prompt, self.geometry.batch, what)

    def check_videos(self, video: VideoInput | None, mask: VideoInput | None,
                     reference_images: Sequence[ImageInput] | None) -> None:
        """Refuse video inputs this bundle's kind does not take, in one line, before anything is read."""
        kinds.check_videos(self.kind, self.manifest.video_to_video, video, mask, reference_images)

    def load_videos(self, video: VideoInput | None, mask: VideoInput | None,
                    reference_images: Sequence[ImageInput] | None) -> dict[str, Any] | None:
        """The video inputs as PIL frames (conditioning.load_videos), or None where the run has none."""
        return conditioning.load_videos(self.kind, video, mask, reference_images)

    def encode(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
               image: ImageInput | None = None, last_image: ImageInput | None = None, size: Size = None,
               frames: int | None = None, video: VideoInput | None = None, mask: VideoInput | None = None,
               reference_images: Sequence[ImageInput] | None = None) -> dict[str, np.ndarray]:
        """Prompt and negative prompt embeddings, float32 (B, L, D), padded positions zero; with an image,
        also its conditioning (`encode_images`) for the shape `size` x `frames` (the default shape's if None).
        VACE kinds: `control` from the `video`, `mask` and `reference_images` (each optional); a video-to-video
        bundle: `video_latents` of the `video` (conditioning.encode_videos). A video's frame count picks the shape's
        frames; it is resized to the shape's size."""
        kinds.check_images(self.kind, image, last_image)
        self.check_videos(video, mask, reference_images)
        if self.kind.forcing and (image is not None or video is not None):
            raise UserError(f"this bundle is {self.kind.title}: its images and videos are pinned latent frames of its "
                            "segments, which `generate` makes (runtime/forcing.py); encode takes the prompt alone")
        media = self.load_videos(video, mask, reference_images)  # unreadable inputs fail before any program runs
        g = self.shape_for_videos(size, frames, *((media["video"], media["references"]) if media else ()))
        if media is not None:
            conditioning.check_videos(self.kind, self.manifest, g, media)
        pil = self._load_images(image, last_image)  # unreadable images fail before any program runs
        out = self.encode_text(prompt, negative_prompt)
        if pil:
            out.update(self._encode_images(g, *pil))
        if media is not None:
            out.update(conditioning.encode_videos(self.kind, g, media["video"], media["mask"], media["references"],
                                                  lambda name: self.call(name, g), fetch, self._encode_chunk(g)))
        return out

    def encode_text(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "") -> dict[str, Any]:
        """The prompt and negative prompt embeddings alone, float32 (B, L, D), padded positions zero: `encode`'s text
        (a loop that encodes its images itself, or a second text such as Wan-Animate 2's reference prompt)."""
        positive, negative = self.prompts(prompt, "prompt"), self.prompts(negative_prompt, "negative_prompt")
        ids, mask = self.tokenizer()(positive + negative, names=tx.names(positive, "prompt") +
                                     tx.names(negative, "negative prompt"))
        n = tx.encoder_length(self.manifest, int(mask.sum(axis=1).max()))
        name = kinds.text_encoder_program(n, self.geometry.max_sequence_length)
        embeds = fetch(self.bundle.call(name)(ids[:, :n], mask[:, :n])).astype(np.float32)
        embeds = np.pad(embeds, ((0, 0), (0, ids.shape[1] - n), (0, 0)))  # padded positions are zero
        b = self.geometry.batch
        return {"prompt_embeds": embeds[:b], "negative_prompt_embeds": embeds[b:]}

    def encode_images(self, image: ImageInput, last_image: ImageInput | None = None, size: Size = None,
                      frames: int | None = None) -> dict[str, np.ndarray]:
        """The image conditioning the denoise and cross_kv programs take (kind.denoise_extras) for the shape
        `size` x `frames`, float32: `image_embeds` (B x images, tokens, D) from CLIP's penultimate layer;
        `condition` (VAE latents of the image(s), with the frame mask in front for "concat" kinds); `mask`
        (1, 1, T, h, w) for "first_frame" kinds."""
        kinds.check_images(self.kind, image, last_image)
        g = self.shape(size, frames)
        return self._encode_images(g, *self._load_images(image, last_image))

    def encode_video(self, pixels: np.ndarray, g: mf.Geometry) -> np.ndarray:
        """VAE latents (1, z, T, h, w), normalised, of a video (F, 3, H, W) in [-1, 1] at shape `g`'s size (what
        runtime/video_input.video_pixels gives)."""
        return conditioning.encode_video(np.ascontiguousarray(np.asarray(pixels, np.float32).transpose(1, 0, 2, 3)),
                                         lambda name: self.call(name, g), fetch, self._encode_chunk(g))

    def _load_images(self, image: ImageInput | None, last_image: ImageInput | None) -> list[Any]:
        if image is None:
            return []
        first = images.load_image(image, "image")
        return [first, images.load_image(last_image, "last image") if last_image is not None else None]

    def _encode_images(self, g: mf.Geometry, first: Any, last: Any | None) -> dict[str, np.ndarray]:
        return conditioning.encode_images(self.kind, g, self.manifest.image_processor, first, last,
                                          lambda name: self.call(name, g), fetch, self._encode_chunk(g))

    def _encode_chunk(self, g: mf.Geometry) -> int:
        """The pixel frames per call of shape `g`'s vae_encode_next program (0 if it has none)."""
        name = self.program_name("vae_encode_next", g)
        return self.manifest.programs[name].inputs["pixels"].shape[2] if name in self.manifest.programs else 0

    def conditioning_inputs(self, embeds: dict[str, np.ndarray], g: mf.Geometry,
                            conditioning_scale: Any = None) -> dict[str, np.ndarray]:
        """The conditioning inputs of shape `g`'s step programs, from `embeds`, checked (conditioning.step_inputs)."""
        return conditioning.step_inputs(self.kind, self.manifest, embeds, g, conditioning_scale,
                                        self.precomputes_kv())

    def precomputes_kv(self) -> bool:
        """Whether this bundle's steps take cross-attention keys and values from its cross_kv programs (every
        bundle exported since they exist) rather than the embeddings (older bundles)."""
        return kinds.cross_kv_program(0) in self.manifest.programs

    def prompt_kv(self, context: np.ndarray, expert: int, rows: int | None,
                  extras: dict[str, np.ndarray] | None = None) -> Any:
        """The cross-attention keys and values of expert `expert` (on the devices) of `context`, the (2B, L, D) prompt
        then negative prompt embeddings (their first `rows` rows, `text_rows`), and of the CLIP kinds' image
        embeddings in `extras`: what every denoising step of a run takes as its `kv`, computed once."""
        if rows is not None:
            context = context[:, :rows]
        return self.bundle.call(kinds.cross_kv_program(expert, rows))(
            context, *[(extras or {})[n] for n in self.kind.kv_inputs[1:]])

    def text_rows(self, context: np.ndarray, programs: Sequence[str] = ()) -> int | None:
        """The rows of the (2B, L, D) embeddings `context` that the steps' cross-attention needs keys and values
        of: the shortest T of this bundle's cross_kv_t<T> programs (CPU bundles; export/cross_kv.py) after which
        every row is zero, if every program in `programs` runs with them; None: all L (what diffusers computes)."""
        return tx.short_rows(self.manifest, tx.used_rows(context), programs)

    def _tokens(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str]) -> int:
        """The most tokens of any of the prompts (the text encoder runs the shortest program that holds them)."""
        _, mask = self.tokenizer()(self.prompts(prompt, "prompt") + self.prompts(negative_prompt, "negative_prompt"))
        return int(mask.sum(axis=1).max())

    # -- settings and steps (runtime/settings.py, runtime/steps.py, runtime/segment.py) --------------------------
    def settings(self, seed: int = 0, steps: int | None = None, guidance: float | None = None,
                 flow_shift: float | None = None, guidance_2: float | None = None, sampler: str | None = None,
                 sigmas: Sequence[float] | None = None) -> DenoiseSettings:
        """The settings of a run, the bundle's defaults (`manifest.defaults`) filling what is None; UserError for
        a bad value. `sampler`: "unipc", "euler" or "dpm++" (runtime/samplers.py); `sigmas`: custom noise levels,
        one per step, before the flow shift (they set the step count)."""
        return st.resolve(self.manifest.defaults, self.kind, self.scheduler_config, seed, steps, guidance,
                          flow_shift, guidance_2, sampler, sigmas)

    def initial_latents(self, seed: int, shape: mf.Geometry | None = None) -> np.ndarray:
        """float32 N(0, 1) noise from jax.random (torch's generator is not reproduced), of the latents of `shape`
        (the default shape if None)."""
        key = jax.random.key(seed)
        return np.asarray(jax.random.normal(key, (shape or self.geometry).latent_shape, jnp.float32))

    def expert_of(self, timestep: float) -> int:
        """0 (`transformer`, high noise) where t >= boundary_ratio x num_train_timesteps, else 1 (`transformer_2`)."""
        return st.expert_of(timestep, self.kind, self.manifest.boundary_ratio, self.scheduler_config)

    def step_programs(self, steps: int, timesteps: np.ndarray, s: DenoiseSettings,
                      magcache: MagCache | None = None, shape: mf.Geometry | None = None) -> list[str]:
        """The denoise program each of the first `steps` steps runs (steps.step_programs), for `shape` (the default
        shape's if None)."""
        experts = [self.expert_of(float(t)) for t in timesteps[:steps]]
        return runner.step_programs(self.manifest, self.kind, shape or self.geometry, experts, s.guidance_of,
                                    magcache)

    def steps_run(self, embeds: dict[str, Any], s: DenoiseSettings, strength: float | None = None) -> int:
        """The denoising steps a run of `s` takes (video-to-video runs only the last ones): what progress counts."""
        return segment.steps_run(self, embeds, s, strength)

    def denoise(self, embeds: dict[str, np.ndarray], seed: int = 0, steps: int | None = None,
                guidance: float | None = None, flow_shift: float | None = None,
                latents: np.ndarray | None = None, progress: bool = True,
                on_step: Callable[[int], None] | None = None, guidance_2: float | None = None,
                magcache: MagCache | None = None, size: Size = None, frames: int | None = None,
                sampler: str | None = None, sigmas: Sequence[float] | None = None,
                conditioning_scale: float | Sequence[float] | None = None, strength: float | None = None,
                noise: np.ndarray | None = None, on_preview: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Run the denoising loop; returns float32 latents (B, z, T, H/s, W/s), what the VAE decodes.

        The shape is that of `latents` if given; else `size` x `frames`; else, with image conditioning in `embeds`,
        the shape it was encoded for; else the default shape.

        `embeds` is what `encode` returns (prompt embeddings, and the image conditioning for image
        models). Two-expert models switch from `transformer` (with `guidance`) to `transformer_2` (with
        `guidance_2`, default `guidance`) below the boundary timestep, as diffusers does. Steps whose
        guidance is <= 1 run the DiT on the prompt alone. `magcache` skips the transformer blocks on the
        steps its schedule says (runtime/magcache.py). `sampler` and `sigmas`: see `settings`.
        `on_step(i)` is called when step i (0-based) is done and checked finite (e.g. to time it). `on_preview(rgb)`
        gets, before it, the step's estimate of the video's middle frame: uint8 RGB, through the bundle's tiny decoder
        where it has one (a frame at the video's size), else through a fixed linear map at the latents' resolution
        (runtime/previews.py; bundles whose latents have no such map and no tiny decoder get none).

        VACE: `conditioning_scale` (default 1), a number or one per VACE layer, scales the VACE blocks' hints.
        Video-to-video (embeds with `video_latents`): `strength` in (0, 1] (default 0.8, diffusers') picks the step
        the run starts at (`samplers.start_step`; only the steps after it run), where the video's latents are mixed
        with `noise` (B, z, T, h, w) (the Gaussian noise diffusers would draw, for reproducing it; default: from
        `seed`); `latents`, if given, start the run as they are.
        """
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
        return segment.denoise(self, embeds, s, latents, progress, on_step, magcache, size, frames,
                               conditioning_scale, strength, noise, on_preview)

    def calibrate(self, embeds: dict[str, np.ndarray], seed: int = 0, steps: int | None = None,
                  guidance: float | None = None, flow_shift: float | None = None, latents: np.ndarray | None = None,
                  progress: bool = True, guidance_2: float | None = None, size: Size = None,
                  frames: int | None = None, sampler: str | None = None,
                  sigmas: Sequence[float] | None = None,
                  conditioning_scale: float | Sequence[float] | None = None) -> list[float]:
        """MagCache's ratios for this bundle and these settings, as diffusers' calibration mode computes them:
        every step runs in full; step i's ratio is the mean over tokens of |residual_i| / |residual_i-1| on the
        prompt (cond) half, 1.0 on each expert's first step."""
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
        return segment.calibrate(self, embeds, s, latents, progress, size, frames, conditioning_scale)

    def first_velocity(self, embeds: dict[str, np.ndarray], seed: int = 0, steps: int | None = None,
                       guidance: float | None = None, flow_shift: float | None = None,
                       latents: np.ndarray | None = None, guidance_2: float | None = None, size: Size = None,
                       frames: int | None = None, sampler: str | None = None,
                       sigmas: Sequence[float] | None = None) -> np.ndarray:
        """The guided velocity the DiT predicts at the first of `steps` steps (B, z, T, H/s, W/s): what
        tools/quality.py compares between two bundles (segment.first_velocity)."""
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
        return segment.first_velocity(self, embeds, s, latents, size, frames)

    # -- decode (runtime/decoding.py) ----------------------------------------------------------------------------
    def decode(self, latents: np.ndarray, decoder: str = "full") -> np.ndarray:
        """float32 frames (B, F, H, W, 3) in [0, 1], at the shape of the latents (the video's: what `denoise`
        returns). `decoder`: "full" (the VAE) or "tiny" (the bundle's tiny decoder, `export --tiny-decoder`: the same
        latents, several times faster, coarser); both decode one latent frame per call, their memory carried."""
        return self.frame_decoder(decoder)(latents)

    def frame_decoder(self, decoder: str = "full") -> decoding.FrameDecoder:
        """A decoder that takes a video's latents a few frames at a time, in order, its memory carried from call to
        call: what the segment loops use to decode each segment's final frames as soon as they are known (the frames
        joined equal one `decode` of all the latents). UserError for a decoder the bundle lacks."""
        return decoding.FrameDecoder(self.bundle, self.decoder_programs(decoder))

    def decoder_programs(self, decoder: str | None) -> str:
        """The chunk programs' prefix of `decoder` ("full", "tiny"; None: "full"); UserError for a name that is
        neither, or "tiny" on a bundle exported without --tiny-decoder."""
        return decoding.decoder_programs(self.manifest, decoder)

    def unload_before(self, stage: str) -> None:
        """Drop the weights no program of `stage` or a later stage uses (decoding.unload_before): a one-shot run then
        peaks at its largest stage rather than their sum; a later call of a dropped stage loads it again."""
        decoding.unload_before(self.bundle, stage)

    # -- a run ---------------------------------------------------------------------------------------------------
    def start_loading(self, s: DenoiseSettings | None = None, g: mf.Geometry | None = None, *, image: bool = False,
                      magcache: MagCache | None = None, prompt: str | Sequence[str] | None = None,
                      negative_prompt: str | Sequence[str] = "") -> None:
        """Start loading, in the background, the stages a run with these settings uses before its first step
        (the denoise programs it runs, the image and video encoders only with `image` true: a run with an image or
        a video), so that the DiT's weights are read while the prompt is encoded; what `generate` does first. With
        the `prompt` (and `negative_prompt`), the cross-attention programs for its length (`text_rows`); without,
        the whole text's. The VAE decoder loads when it is needed: in the background it would compete with the
        denoising steps for the cores (measured: step 1 done 4 s later on 2 cores). `s`: the run's settings (the
        bundle's defaults if None); the programs are those of shape `g` (the default shape if None). Raises UserError
        for a sampler the bundle's programs cannot run, before any work."""
        s = self.settings() if s is None else s
        g = self.geometry if g is None else g
        plan = s.plan(self.scheduler_config)
        denoising = self.step_programs(s.steps, plan.timesteps, s, magcache, g)
        # a sampler the bundle's programs cannot run fails before any work
        runner.timestep_cast(self.manifest, denoising[0], plan.timesteps, s.sampler)
        rows = None
        if prompt is not None and self.precomputes_kv():
            rows = tx.short_rows(self.manifest, self._tokens(prompt, negative_prompt), denoising)
        experts = {self.expert_of(float(t)) for t in plan.timesteps[: s.steps]}
        stage = kinds.pipeline_stage
        self.bundle.prefetch([n for n in self.manifest.programs if stage(n) != "decode"
                              and not kinds.is_text_encoder(n)  # encode loads the one its prompts need, at once
                              and (image or not n.startswith("vae_encode"))
                              and (not kinds.shape_scope(n) or n == self.program_name(kinds.base_program(n), g))
                              and (not kinds.is_cross_kv(n) or n in {kinds.cross_kv_program(e, rows) for e in experts})
                              and (kinds.denoise_variant(n) is None or n in denoising)])
        for name in dict.fromkeys(denoising):
            if self.manifest.programs[name].blocks is not None:
                self.bundle.prefetch_part(name, "block" if rows is None else f"{mf.SHORT_BLOCK}{rows}")

    def generate(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "", *args: Any,
                 **kwargs: Any) -> np.ndarray:
        """prompt (+ images, videos) -> frames (B, F, H, W, 3) float32 in [0, 1], by the bundle kind's loop
        (kinds.Kind.loop):

        - one bundle shape (runtime/segment.py): every kind without a loop of its own. `size` ("WxH") and `frames`
          pick one of the bundle's shapes (`shapes`; the default one where None; a video's frame count picks the
          frames); `latents` is the initial noise, as diffusers' `latents` argument: (B, z, T, H/s, W/s), and picks
          the shape itself. `magcache`: see `denoise`. `sampler` ("unipc", "euler", "dpm++") and `sigmas` (custom
          noise levels, one per step): see `settings`. VACE kinds: `video` (the control or source frames), `mask`
          (1 = generate, 0 = keep) and `reference_images` (a list), each optional, and `conditioning_scale`;
          video-to-video bundles: `video`, `strength` and `noise` (see `denoise`). A video is a path (mp4, webm, gif,
          a folder of numbered images), a list of PIL images or an (F, H, W, 3) array (runtime/video_input.py).
          Flow-map models (AnyFlow): `video`, the first frames to continue (4k+1, fewer than the run makes: kept as
          they are, AnyFlowPipeline's `video`); `use_mean_velocity` as diffusers has it (True: sampler flowmap, the
          default; False: sampler euler, r = t);
        - Wan-Animate (runtime/animate.py `generate`): `image`, `pose_video`, `face_video`, `mode`, ...;
        - diffusion forcing (runtime/forcing.py `generate`): `num_frames` of any length, `overlap_history`,
          `ar_step`, `causal_block_size`, `addnoise_condition`, `image`, `last_image`, `video`, `latents` (one initial
          noise per segment), `fps`;
        - Helios (runtime/helios.py `generate`): `num_frames` of any length (whole chunks), `image`, `video`,
          `latents` (one initial noise per chunk), add_noise_to_image_latents, image_noise_sigma_min/max,
          add_noise_to_video_latents, video_noise_sigma_min/max, is_skip_first_chunk;
        - ChronoEdit (runtime/chronoedit.py `generate`): `image`, `temporal_reasoning_steps`;
        - Wan-Animate 2 (runtime/animate2.py `generate`): `image` (the character), `driving_video` (any length),
          `prompt_ref`, `prev_segment_conditioning_frames`, `driving_video_fps`, `fps`, `latents` (one initial noise
          per segment);
        - AnyFlow-FAR (runtime/far.py `generate`): causal chunks with a KV cache; `image` (the first chunk's context),
          `video` (4k + 1 first frames as context), `latents` (the whole video's noise), `use_mean_velocity`,
          `prompt_changes` {chunk: prompt} (the cache re-encoded under it); `runtime.far.stream` yields the chunks.

        The shared keywords mean the same everywhere: `seed`, `steps`, `guidance`, `guidance_2`, `flow_shift`,
        `sampler`, `sigmas`, `size`, `frames`, `progress`; `low_memory` (drop each stage's weights once the run is
        past it, `unload_before`); `on_step(done, total)` follows the denoising steps (it may raise to stop the run);
        `on_preview(rgb)` gets each step's estimate of the video's middle frame (see `denoise`); `decoder` "full" (the
        VAE) or "tiny" (the bundle's tiny decoder); `on_frames(frames)` gets the frames as they are decoded (the
        segment loops call it for each segment's frames as they are made). `loras` (the LoRA set, `use_loras`) is
        switched to before any loop runs; None keeps the set the weights hold. `stream` (a directory): the video as
        an HLS live stream there while it is made, `stream.m3u8` and `stream/<n>.ts` (runtime/hls.py), a segment for
        each part as it is decoded, ended when the call returns or fails (the first video of a batch; at `fps`,
        default the bundle's); it is opened only once the run's settings are checked, so a refused run writes
        nothing."""
        loop = self.kind.loop
        loras = kwargs.pop("loras", None)
        stream = kwargs.pop("stream", None)
        front.check_keywords(self.kind, kwargs)
        if loras is not None:  # before any loop: whichever runs, its programs use the weights of this set
            self.use_loras(loras)
        if stream is not None:
            return self._streamed(stream, LOOPS[loop], prompt, negative_prompt, *args, **kwargs)
        return LOOPS[loop](self, prompt, negative_prompt, *args, **kwargs)

    def _streamed(self, stream: str | Path, loop: Callable[..., np.ndarray], prompt: Any, negative_prompt: Any,
                  *args: Any, **kwargs: Any) -> np.ndarray:
        """The loop with its frames written to an HLS stream in directory `stream` as they come. The stream is written
        from the first frames on, after every setting of the run was checked: a refused run leaves nothing behind."""
        from . import hls

        fps = kwargs.get("fps") or self.manifest.defaults.fps
        writer = hls.HlsWriter(hls.directory_sink(stream), fps, open_now=False)
        given = kwargs.pop("on_frames", None)

        def on_frames(frames: np.ndarray) -> None:
            writer.add(frames)
            if given is not None:
                given(frames)

        try:
            return loop(self, prompt, negative_prompt, *args, on_frames=on_frames, **kwargs)
        finally:
            writer.end()  # a failed run's stream ends where it stopped; a refused run's was never written

    def edit_image(self, image: Any, prompt: str, negative_prompt: str = "", seed: int = 0,
                   steps: int | None = None, guidance: float | None = None, temporal_reasoning_steps: int = 0,
                   frames: int | None = None, **kwargs: Any) -> Any:
        """The edited image (a PIL RGB image of the bundle shape's size) of an image-editing bundle (ChronoEdit):
        the last frame of the short video the edit is made as (runtime/chronoedit.py `edit_image`, where the
        keywords are). UserError (one line) for a bundle of another kind or bad input, before any work."""
        return chronoedit.edit_image(self, image, prompt, negative_prompt, seed=seed, steps=steps, guidance=guidance,
                                     temporal_reasoning_steps=temporal_reasoning_steps, frames=frames, **kwargs)


def load(path: str | Path, verify: bool = True, loras: Sequence[adapters.LoraSpec] | None = None,
         lora_dir: str | Path | None = None) -> Pipeline:
    """Open the bundle at `path` (every file checked against the manifest's sha256). `loras`: adapters made by
    `python -m export lora`, as (path, scale) pairs (or (path, scale, expert)), merged into the DiT weights as they
    are placed. `lora_dir`: a directory of such adapters, each checked against the bundle now, that `loras` here and
    in `generate(..., loras=...)` / `use_loras` may name (file name without .safetensors; `Pipeline.loras`)."""
    named = adapters.scan(Path(lora_dir), mf.read(Path(path))) if lora_dir is not None else None
    return Pipeline(open_bundle(path, verify=verify, loras=loras, named=named), loras, named)
