"""encode -> denoise -> decode on a bundle, with no torch anywhere: the one-segment engine.

The loops over segments (Wan-Animate's runtime/animate.py, diffusion forcing's runtime/forcing.py) run above it, on
its methods; runtime/front.py's `generate` picks the loop by kind. Nothing this module imports imports them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from . import adapters, conditioning, host_memory, images, kinds, previews, samplers, scheduler, signatures, video_input
from . import magcache as magcache_rule
from . import manifest as mf
from . import settings as st
from .bundle import Bundle, open_bundle
from .distributed import fetch, is_primary, put
from .errors import UserError
from .kinds import Kind
from .magcache import MagCache
from .scheduler import TIMESTEP_SCALE, scaled_timesteps
from .settings import MAX_SEED, DenoiseSettings  # noqa: F401  (public names of this module)
from .text import PromptTokenizer, check_prompt

log = logging.getLogger("runtime")

ImageInput = Any  # a PIL image, a path, or a uint8 (H, W, 3) array (runtime/images.py)
VideoInput = video_input.VideoInput  # a path, a folder of images, PIL frames or an (F, H, W, 3) array


Size = str | tuple[int, int] | None  # "WxH" or (width, height); None: the default shape's


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
        self.scheduler_config = scheduler.UniPCConfig.from_json(self.manifest.scheduler)

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

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The (width, height, frames) this bundle makes, the default first."""
        return [g.shape for g in self.manifest.shapes]

    def shape(self, size: Size = None, frames: int | None = None, reference_images: int | None = None) -> mf.Geometry:
        """The bundle's shape of this size ("WxH" or (width, height)), frame count and count of reference images
        (VACE); what is None is the default shape's (or, for a size whose shapes lack the default's frames, that
        size's first). UserError naming the bundle's shapes (or reference image counts) if it has none such."""
        d = self.geometry
        width, height = parse_size(size) if size is not None else (d.width, d.height)
        if frames is not None and (isinstance(frames, bool) or not isinstance(frames, (int, np.integer))):
            raise UserError(f"frames must be an integer, got {frames!r}")
        refs = d.reference_images if reference_images is None else reference_images
        g = self.manifest.find_shape(width, height, d.frames if frames is None else int(frames), refs)
        if g is None and frames is None:
            g = self.manifest.find_shape(width, height, None, refs)
        if g is None:
            counts = self.manifest.reference_counts
            if refs not in counts and self.manifest.find_shape(width, height, frames) is not None:
                raise UserError(f"{refs} reference image{'s' * (refs != 1)}: this bundle serves "
                                f"{' or '.join(map(str, counts))} (export with --reference-images for others)")
            asked = f"{width}x{height} x {frames if frames is not None else d.frames} frames"
            raise UserError(f"this bundle makes no {asked} video: its shapes are {self.manifest.shapes_text()} "
                            "(export one with --resolution/--frames for others)")
        return g

    def shape_for_videos(self, size: Size = None, frames: int | None = None, video: Sequence[Any] | None = None,
                         reference_images: Sequence[Any] | None = None) -> mf.Geometry:
        """The shape a run with these video inputs makes: `video`'s frame count is the shape's frames (it must agree
        with `frames`), and a VACE bundle's shape has as many reference image frames as `reference_images`.
        UserError naming what the bundle makes otherwise."""
        if video is not None and self.kind.video == "prefix":  # the video's frames start the shape's (AnyFlow)
            return self.shape(size, frames)
        if video is not None:
            n = len(video)
            if frames is not None and frames != n:
                raise UserError(f"the video has {n} frames but frames={frames} was asked: give a video of {frames} "
                                "frames, or leave frames out")
            counts = [g.frames for g in self.manifest.shapes]
            if n not in counts:
                made = " or ".join(map(str, sorted(set(counts))))
                raise UserError(f"the video has {n} frames; this bundle makes {made} (its shapes: "
                                f"{self.manifest.shapes_text()}): trim or pad the video, or export with "
                                "--frames for its count (4k+1)")
            frames = n
        refs = len(reference_images or []) if self.kind.vace else None
        return self.shape(size, frames, refs)

    def shape_of_latents(self, shape: tuple[int, ...], video: bool = False) -> mf.Geometry:
        """The bundle's shape whose denoised latents (`video`: the video's latents the VAE decodes, VACE's reference
        frames dropped) have this shape; UserError naming the shapes if none."""
        for g in self.manifest.shapes:
            if tuple(shape) == (g.video_latent_shape if video else g.latent_shape):
                return g
        want = ", ".join(f"{list(g.video_latent_shape if video else g.latent_shape)} ({g.describe()})"
                         for g in self.manifest.shapes)
        raise UserError(f"latents have shape {list(shape)}, this bundle needs one of {want}")

    def _at(self, program: str, g: mf.Geometry) -> str:
        """The name of program `program` (as kinds names it) for shape `g`."""
        return self.manifest.program_for(program, g)

    def call(self, program: str, g: mf.Geometry) -> Callable[..., Any]:
        """Program `program` (as kinds names it) of shape `g`, compiled, its weights bound: fn(*inputs) in call
        order (runtime/signatures.py)."""
        return self.bundle.call(self._at(program, g))

    def encode_video(self, pixels: np.ndarray, g: mf.Geometry) -> np.ndarray:
        """VAE latents (1, z, T, h, w), normalised, of a video (F, 3, H, W) in [-1, 1] at shape `g`'s size (what
        runtime/video_input.video_pixels gives)."""
        return conditioning.encode_video(np.ascontiguousarray(np.asarray(pixels, np.float32).transpose(1, 0, 2, 3)),
                                         lambda name: self.call(name, g), fetch, self._encode_chunk(g))

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

    # -- text and images ----------------------------------------------------
    def tokenizer(self) -> PromptTokenizer:
        if self._tokenizer is None:
            path = mf.resolve(self.bundle.path, self.manifest.tokenizer.file)
            self._tokenizer = PromptTokenizer.from_file(path, self.geometry.max_sequence_length)
        return self._tokenizer

    def _prompts(self, prompt: str | Sequence[str], what: str) -> list[str]:
        b = self.geometry.batch
        if isinstance(prompt, str):
            prompts = [prompt] * b
        else:
            prompts = list(prompt) if isinstance(prompt, (list, tuple)) else []
            if len(prompts) != b or not all(isinstance(p, str) for p in prompts):
                raise UserError(f"{what} must be a string or a list of {b} strings (the bundle's batch size)")
        if what == "prompt":  # a negative prompt may be empty (diffusers' default); a prompt may not
            for p, name in zip(prompts, _names(prompts, "prompt")):
                check_prompt(p, name)
        return prompts

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
        kinds.check_videos(self.kind, self.manifest.video_to_video, video, mask, reference_images)
        if self.kind.forcing and (image is not None or video is not None):
            raise UserError(f"this bundle is {self.kind.title}: its images and videos are pinned latent frames of its "
                            "segments, which `generate` makes (runtime/forcing.py); encode takes the prompt alone")
        media = self._load_videos(video, mask, reference_images)  # unreadable inputs fail before any program runs
        g = self.shape_for_videos(size, frames, *((media["video"], media["references"]) if media else ()))
        if media is not None:
            self._check_videos(g, media)
        pil = self._load_images(image, last_image)  # unreadable images fail before any program runs
        positive, negative = self._prompts(prompt, "prompt"), self._prompts(negative_prompt, "negative_prompt")
        ids, mask = self.tokenizer()(positive + negative, names=_names(positive, "prompt") +
                                     _names(negative, "negative prompt"))
        n = self._text_length(int(mask.sum(axis=1).max()))
        name = kinds.text_encoder_program(n, self.geometry.max_sequence_length)
        embeds = fetch(self.bundle.call(name)(ids[:, :n], mask[:, :n])).astype(np.float32)
        embeds = np.pad(embeds, ((0, 0), (0, ids.shape[1] - n), (0, 0)))  # padded positions are zero
        b = self.geometry.batch
        out = {"prompt_embeds": embeds[:b], "negative_prompt_embeds": embeds[b:]}
        if pil:
            out.update(self._encode_images(g, *pil))
        if media is not None:
            out.update(conditioning.encode_videos(self.kind, g, media["video"], media["mask"], media["references"],
                                                  lambda name: self.bundle.call(self._at(name, g)), fetch,
                                                  self._encode_chunk(g)))
        return out

    def _load_videos(self, video: VideoInput | None, mask: VideoInput | None,
                     reference_images: Sequence[ImageInput] | None) -> dict[str, Any] | None:
        """The video inputs as PIL frames, or None where the run has none (VACE kinds always have some: no video is
        a zero video)."""
        if video is None and not self.kind.vace:
            return None
        refs = list(reference_images or [])
        if reference_images is not None and not isinstance(reference_images, (list, tuple)):
            raise UserError("reference_images must be a list of images (PIL images, paths or uint8 arrays)")
        return {"video": None if video is None else video_input.load_frames(video, "video"),
                "mask": None if mask is None else video_input.load_mask(mask, "mask"),
                "references": [images.load_image(r, f"reference image {i + 1}") for i, r in enumerate(refs)]}

    def _check_videos(self, g: mf.Geometry, media: dict[str, Any]) -> None:
        video, mask = media["video"], media["mask"]
        if video is not None and self.kind.video == "prefix":
            n, scale = len(video), g.temporal_scale
            if n % scale != 1 or n >= g.frames:
                raise UserError(f"the video has {n} frames: give the first frames to continue, 4k+1 of them (1, 5, "
                                f"9, ...) and fewer than the {g.frames} this run makes at {g.size}")
            return
        if video is not None and len(video) != g.frames:
            raise UserError(f"the video has {len(video)} frames; this bundle makes {g.frames} at {g.size}: its shapes "
                            f"are {self.manifest.shapes_text()}")
        if mask is not None:
            want = len(video) if video is not None else g.frames
            if len(mask) != want:
                raise UserError(f"the mask has {len(mask)} frame{'s' * (len(mask) != 1)}, the "
                                f"{'video' if video else 'shape'} {want}: give one mask frame per video frame")
            if video is not None and mask[0].size != video[0].size:
                raise UserError(f"the mask is {mask[0].width}x{mask[0].height}, the video "
                                f"{video[0].width}x{video[0].height}: give a mask of the video's size")

    def _encode_chunk(self, g: mf.Geometry) -> int:
        """The pixel frames per call of shape `g`'s vae_encode_next program (0 if it has none)."""
        name = self._at("vae_encode_next", g)
        return self.manifest.programs[name].inputs["pixels"].shape[2] if name in self.manifest.programs else 0

    def _text_length(self, tokens: int) -> int:
        """The shortest text encoder program of this bundle that holds `tokens` (kinds.text_lengths; bundles
        exported before those existed have only the full one)."""
        L = self.geometry.max_sequence_length
        have = [n for n in kinds.text_lengths(L) if kinds.text_encoder_program(n, L) in self.manifest.programs]
        return min((n for n in have if n >= tokens), default=L)

    def encode_images(self, image: ImageInput, last_image: ImageInput | None = None, size: Size = None,
                      frames: int | None = None) -> dict[str, np.ndarray]:
        """The image conditioning the denoise and cross_kv programs take (kind.denoise_extras) for the shape
        `size` x `frames`, float32: `image_embeds` (B x images, tokens, D) from CLIP's penultimate layer;
        `condition` (VAE latents of the image(s), with the frame mask in front for "concat" kinds); `mask`
        (1, 1, T, h, w) for "first_frame" kinds."""
        kinds.check_images(self.kind, image, last_image)
        g = self.shape(size, frames)
        return self._encode_images(g, *self._load_images(image, last_image))

    def _load_images(self, image: ImageInput | None, last_image: ImageInput | None) -> list[Any]:
        if image is None:
            return []
        first = images.load_image(image, "image")
        return [first, images.load_image(last_image, "last image") if last_image is not None else None]

    def _encode_images(self, g: mf.Geometry, first: Any, last: Any | None) -> dict[str, np.ndarray]:
        return conditioning.encode_images(self.kind, g, self.manifest.image_processor, first, last,
                                          lambda name: self.bundle.call(self._at(name, g)), fetch,
                                          self._encode_chunk(g))

    # -- denoise ------------------------------------------------------------
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

    def _timestep_cast(self, program: str, s: DenoiseSettings) -> Callable[[float], np.generic]:
        """The timestep as program `program` takes it: the schedule's (sigma x 1000) times the bundle's
        timestep_scale / 1000, as float32 (bundles of schema 9 on), or int32 in older bundles, whose programs cannot
        take Euler's fractional timesteps (UserError, before any work)."""
        scale = self.manifest.defaults.timestep_scale
        if self.manifest.programs[program].inputs["timestep"].dtype == "float32":
            return np.float32 if scale == TIMESTEP_SCALE else (lambda t: scaled_timesteps(t, scale))
        if scale != TIMESTEP_SCALE:  # only an edited manifest gets here: its migration sets 1000
            raise UserError(f"this bundle's programs take whole-number timesteps (it was exported by an older "
                            f"wan-aot), which cannot carry timestep_scale {scale:g}: re-export the bundle")
        plan = s.plan(self.scheduler_config)
        if not np.array_equal(plan.timesteps, np.round(plan.timesteps)):
            raise UserError(f"this bundle's programs take whole-number timesteps (it was exported by an older "
                            f"wan-aot), and the {s.sampler} sampler's are fractional: re-export the bundle, or use "
                            "sampler unipc or dpm++")
        return np.int32

    def precomputes_kv(self) -> bool:
        """Whether this bundle's steps take cross-attention keys and values from its cross_kv programs (every
        bundle exported since they exist) rather than the embeddings (older bundles)."""
        return kinds.cross_kv_program(0) in self.manifest.programs

    def _conditioning(self, embeds: dict[str, np.ndarray], g: mf.Geometry,
                      conditioning_scale: Any = None) -> dict[str, np.ndarray]:
        """The conditioning inputs of the denoise (and cross_kv) programs of shape `g`, by name (kind.denoise_extras),
        from `embeds`; text mode of a "first_frame" kind without one; a VACE kind's `control_scale` from
        `conditioning_scale`."""
        programs = self.manifest.programs
        specs = dict(programs[self._at(kinds.denoise_program(0), g)].inputs)
        if self.precomputes_kv():
            specs.update(programs[kinds.cross_kv_program(0)].inputs)
        if self.kind.conditioning in ("first_frame", "flowmap") and "condition" not in embeds:  # as text-to-video
            embeds = {**embeds, **conditioning.text_mode(self.kind, {k: v.shape for k, v in specs.items()})}
        if self.kind.vace:
            scale = 1.0 if conditioning_scale is None else conditioning_scale
            embeds = {**embeds, "control_scale": conditioning.control_scale(scale, specs["control_scale"].shape[0])}
        elif conditioning_scale is not None:
            raise UserError(f"conditioning_scale is for VACE models; this bundle is {self.kind.title}")
        out = {}
        for name in self.kind.denoise_extras:
            if name in kinds.STEP_INPUTS:  # the loop's, per step
                continue
            if name not in embeds:
                what = "video inputs" if self.kind.vace else "video (--video / video=...)" \
                    if self.kind.video == "required" else "image (--image / image=...)"
                raise UserError(f"this bundle is {self.kind.title}: the embeddings have no {name!r}; encode with "
                                f"the {what}")
            value = np.asarray(embeds[name], np.float32)
            if value.shape != specs[name].shape:
                also = f" at {g.size} x {g.frames} frames (encode with the same size and frames)" \
                    if len(self.manifest.shapes) > 1 else ""
                raise UserError(f"{name} has shape {list(value.shape)}, this bundle needs {list(specs[name].shape)}"
                                + also)
            if not np.isfinite(value).all():
                raise UserError(f"{name} contains NaN or inf")
            out[name] = value
        return out

    def _inputs(self, program: str) -> tuple[str, ...]:
        """The names of program `program`'s inputs, in the order it takes them."""
        return signatures.call_order(program, self.kind, self.manifest.programs[program]).inputs

    def program_inputs(self, program: str) -> tuple[str, ...]:
        """The names of program `program`'s inputs, in call order (runtime/signatures.py)."""
        return self._inputs(program)

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
        used = np.flatnonzero(np.any(context != 0, axis=(0, 2)))  # NaN counts as used
        return self._short_rows(int(used[-1]) + 1 if used.size else 0, programs)

    def _short_rows(self, needed: int, programs: Sequence[str]) -> int | None:
        have = self.manifest.programs
        for t in kinds.short_text_lengths(self.geometry.max_sequence_length):
            if t >= needed and kinds.cross_kv_program(0, t) in have and all(self._takes_rows(p, t) for p in programs):
                return t
        return None

    def _tokens(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str]) -> int:
        """The most tokens of any of the prompts (the text encoder runs the shortest program that holds them)."""
        _, mask = self.tokenizer()(self._prompts(prompt, "prompt") + self._prompts(negative_prompt, "negative_prompt"))
        return int(mask.sum(axis=1).max())

    def _takes_rows(self, program: str, rows: int) -> bool:
        spec = self.manifest.programs[program]
        if spec.blocks is not None:
            return str(rows) in spec.blocks.short_blocks
        return "kv" not in spec.inputs

    def step_programs(self, steps: int, timesteps: np.ndarray, s: DenoiseSettings,
                      magcache: MagCache | None = None, shape: mf.Geometry | None = None) -> list[str]:
        """The denoise program each step runs: the step's expert; with `magcache`, its full ("_residual") or
        cached ("_cached") step as MagCache's schedule says; else the cond-only program ("_cond") where the
        step's guidance is <= 1 (the uncond half would be computed for nothing), else the CFG step. Bundles
        exported before the variants existed have only the CFG step: it serves every step but MagCache. The
        programs are `shape`'s (the default shape's if None)."""
        experts = [self.expert_of(float(t)) for t in timesteps[:steps]]
        have = self.manifest.programs
        g = shape or self.geometry
        at = self._at
        if magcache is not None:
            if "residual" not in self.kind.variants:
                raise UserError(f"this bundle is {self.kind.title}: MagCache is not for its steps (diffusion forcing's "
                                "per-frame timesteps give its per-step schedule nothing to go by)")
            if kinds.denoise_program(0, "residual") not in have:
                raise UserError("this bundle has no MagCache programs (it was exported by an older wan-aot): "
                                "re-export it to use MagCache")
            compute = magcache.schedule(experts)
            return [at(kinds.denoise_program(e, "residual" if c else "cached"), g) for e, c in zip(experts, compute)]
        out = []
        for e in experts:
            cond_only = s.guidance_of(e) <= 1.0 and at(kinds.denoise_program(e, "cond"), g) in have
            out.append(at(kinds.denoise_program(e, "cond" if cond_only else "cfg"), g))
        return out

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
        gets, before it, the step's estimate of the video's middle frame: uint8 (h, w, 3) at the latents' resolution,
        from the denoised estimate the scheduler holds, through a fixed linear map (runtime/previews.py; bundles whose
        latents have no such map get none).

        VACE: `conditioning_scale` (default 1), a number or one per VACE layer, scales the VACE blocks' hints.
        Video-to-video (embeds with `video_latents`): `strength` in (0, 1] (default 0.8, diffusers') picks the step
        the run starts at (`samplers.start_step`; only the steps after it run), where the video's latents are mixed
        with `noise` (B, z, T, h, w) (the Gaussian noise diffusers would draw, for reproducing it; default: from
        `seed`); `latents`, if given, start the run as they are.
        """
        return self._denoise(embeds, seed, steps, guidance, flow_shift, latents, progress, on_step, guidance_2,
                             magcache, size=size, frames=frames, sampler=sampler, sigmas=sigmas,
                             conditioning_scale=conditioning_scale, strength=strength, noise=noise,
                             on_preview=on_preview)

    def calibrate(self, embeds: dict[str, np.ndarray], seed: int = 0, steps: int | None = None,
                  guidance: float | None = None, flow_shift: float | None = None, latents: np.ndarray | None = None,
                  progress: bool = True, guidance_2: float | None = None, size: Size = None,
                  frames: int | None = None, sampler: str | None = None,
                  sigmas: Sequence[float] | None = None,
                  conditioning_scale: float | Sequence[float] | None = None) -> list[float]:
        """MagCache's ratios for this bundle and these settings, as diffusers' calibration mode computes them:
        every step runs in full; step i's ratio is the mean over tokens of |residual_i| / |residual_i-1| on the
        prompt (cond) half, 1.0 on each expert's first step."""
        ratios: list[float] = []
        everything = MagCache([1.0], threshold=0.0, max_skip_steps=0, retention_ratio=1.0)  # never skips
        self._denoise(embeds, seed, steps, guidance, flow_shift, latents, progress, None, guidance_2, everything,
                      calibration=ratios, size=size, frames=frames, sampler=sampler, sigmas=sigmas,
                      conditioning_scale=conditioning_scale)
        return ratios

    def _denoise(self, embeds: dict[str, np.ndarray], seed: int, steps: int | None, guidance: float | None,
                 flow_shift: float | None, latents: np.ndarray | None, progress: bool,
                 on_step: Callable[[int], None] | None, guidance_2: float | None, magcache: MagCache | None,
                 calibration: list[float] | None = None, size: Size = None, frames: int | None = None,
                 stop_after: int | None = None, sampler: str | None = None,
                 sigmas: Sequence[float] | None = None, conditioning_scale: Any = None, strength: float | None = None,
                 noise: np.ndarray | None = None, on_preview: Callable[[np.ndarray], None] | None = None,
                 resume: tuple[int, np.ndarray] | None = None) -> np.ndarray:
        # `resume` (step i, state): run steps i.. of this schedule from that whole scheduler state (what `stop_after`
        # returns, possibly of another shape's run: runtime/chronoedit.py's temporal reasoning goes on from K steps
        # over N frames with the state's rows cut to 2 latent frames, as diffusers trims UniPC's history).
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
        if magcache is not None and not isinstance(magcache, MagCache):
            raise UserError("magcache must be a runtime.MagCache (e.g. MagCache(ratios=[...]))")
        g = self.denoise_shape(embeds, latents, size, frames)
        start = self.start_step(embeds, s, strength)
        if noise is not None and "video_latents" not in embeds:
            raise UserError("noise is for video-to-video (a video given to encode): other runs take `latents`")
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            if key not in embeds:
                raise UserError(f"embeds has no {key!r}")
            if tuple(np.shape(embeds[key])) != g.embeds_shape:
                raise UserError(f"{key} has shape {list(np.shape(embeds[key]))}, "
                                f"this bundle needs {list(g.embeds_shape)}")
        extras = self._conditioning(embeds, g, conditioning_scale)
        plan = s.plan(self.scheduler_config, start)
        begin, resumed = (0, None) if resume is None else (int(resume[0]), np.asarray(resume[1], np.float32))
        if resumed is not None:
            want = (scheduler.state_rows(self.scheduler_config.solver_order), *g.latent_shape)
            if latents is not None or not 0 < begin < len(plan.timesteps) or resumed.shape != want:
                raise ValueError(f"resume takes a step in 1..{len(plan.timesteps) - 1} and a state of shape "
                                 f"{list(want)}, without latents")
            latents = resumed[0]
        if latents is None and "video_latents" in embeds:  # video-to-video: the video's latents, noised
            latents = conditioning.noised(self._video_latents(embeds, g), self._noise(noise, s.seed, g),
                                          float(plan.sigmas[0]))
        if latents is None:
            latents = self.initial_latents(s.seed, g)
        latents = np.asarray(latents, np.float32)
        if not np.isfinite(latents).all():
            raise UserError("initial latents contain NaN or inf")

        run = len(plan.timesteps)
        programs = self.step_programs(run, plan.timesteps, s, magcache, g)
        timestep_of = self._timestep_cast(programs[0], s)
        order = self.scheduler_config.solver_order
        state = np.zeros((scheduler.state_rows(order), *g.latent_shape), np.float32) if resumed is None else resumed
        state[0] = latents
        prompt = np.asarray(embeds["prompt_embeds"], np.float32)
        contexts = {True: np.concatenate([prompt, embeds["negative_prompt_embeds"]]).astype(np.float32),
                    False: prompt}
        with_kv = self.precomputes_kv()
        rows = self.text_rows(contexts[True], programs) if with_kv else None
        step_extras = [n for n in (self.kind.conditioning_inputs if with_kv else self.kind.denoise_extras)
                       if n not in kinds.STEP_INPUTS]
        r_timesteps = self._r_timesteps(plan, s, extras, timestep_of) if self.kind.flow_map else None
        # The state and conditioning are placed once (as the first program wants them; the variants share their
        # layout) and shared by the experts.
        first = dict(zip(self._inputs(programs[0]), self.bundle.call_shardings(programs[0]), strict=True))
        state_dev = put(state, first["state"])
        extras_dev = {n: put(extras[n], first[n]) for n in step_extras}
        contexts_dev: dict[Any, Any] = {}  # context by cfg (older bundles), or keys and values by expert
        guidances = [np.float32(s.guidance_of(e)) for e in range(2)]
        residual = norms = None
        expert_before = -1
        preview = self._previewer(g) if on_preview is not None else None
        for i in tqdm(range(begin, run), initial=begin, total=run, desc="denoising", unit="step",
                      disable=not progress or not is_primary()):
            name = programs[i]
            variant = kinds.denoise_variant(name)
            e = self.expert_of(float(plan.timesteps[i]))
            text = ("kv", e) if with_kv else variant.cfg
            if text not in contexts_dev:
                if with_kv:  # once per prompt and expert: every step's cross-attention keys and values
                    contexts_dev[text] = self.prompt_kv(contexts[True], e, rows, extras)
                else:
                    contexts_dev[text] = put(contexts[variant.cfg], self.bundle.input_shardings(name)[1])
            values = {"state": state_dev, "kv": contexts_dev[text], "context": contexts_dev[text],
                      "timestep": timestep_of(plan.timesteps[i]), "guidance": guidances[e], "row": plan.coeffs[i],
                      **extras_dev, "residual": residual,
                      "r_timestep": None if r_timesteps is None else r_timesteps[i]}
            outs = self.bundle.call(name)(*[values[n] for n in self._inputs(name)])
            state_dev, finite = outs[0], outs[1]
            if variant.residual == "out":
                residual = outs[2]
            if not bool(fetch(finite)):
                raise UserError(f"non-finite values (NaN/inf) appeared in the latents at denoising step {i + 1} of "
                                f"{run}: check the weights, guidance ({guidances[e]}) and dtype")
            if calibration is not None:
                now = fetch(jnp.linalg.norm(residual[: g.batch].astype(jnp.float32), axis=-1))
                calibration.append(magcache_rule.calibration_ratio(now, norms if e == expert_before else None))
                norms, expert_before = now, e
            if preview is not None:
                on_preview(preview(state_dev))  # type: ignore[misc]
            if on_step is not None:
                on_step(i)
            if stop_after is not None and i + 1 == stop_after:
                return fetch(state_dev).astype(np.float32)  # every row of the scheduler's state
        out = fetch(state_dev)[0].astype(np.float32)
        return conditioning.after_loop(self.kind, extras, out, g)

    @staticmethod
    def _r_timesteps(plan: scheduler.Plan, s: DenoiseSettings, extras: dict[str, np.ndarray],
                     timestep_of: Callable[[float], Any]) -> list[np.ndarray]:
        """A flow-map model's target timestep of each frame at each step (T,): the next sigma x 1000 (the mean
        velocity's r; 0 after the last step), or with sampler euler the frame's own timestep (AnyFlowPipeline's
        use_mean_velocity=False, whose r_timestep is its timestep tensor, zeroed on the given frames with it)."""
        denoised = extras["mask"][0, 0, :, 0, 0]  # 1 on the frames made, 0 on a given video's
        ts = [float(t) for t in plan.timesteps]
        out = []
        for i, t in enumerate(ts):
            r = (ts[i + 1] if i + 1 < len(ts) else 0.0) if s.mean_velocity else None
            out.append(np.asarray([timestep_of(t * m if r is None else r) for m in denoised], np.float32))
        return out

    def start_step(self, embeds: dict[str, Any], s: DenoiseSettings, strength: float | None) -> int:
        """The first of the schedule's steps a run takes: 0, or for video-to-video (embeds with `video_latents`) the
        one `strength` picks (samplers.start_step: at least the last step runs); UserError for a bad strength."""
        if "video_latents" not in embeds:
            if strength is not None:
                raise UserError("strength is for video-to-video: a source video given to a bundle exported with "
                                "--video-to-video")
            return 0
        strength = 0.8 if strength is None else strength
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 < strength <= 1:
            raise UserError(f"strength must be a number in (0, 1], got {strength!r}")
        return samplers.start_step(s.steps, strength)

    def steps_run(self, embeds: dict[str, Any], s: DenoiseSettings, strength: float | None = None) -> int:
        """The denoising steps a run of `s` takes: the schedule's from start_step on (video-to-video runs only the
        last ones), what progress counts."""
        return len(s.plan(self.scheduler_config, self.start_step(embeds, s, strength)).timesteps)

    def _video_latents(self, embeds: dict[str, Any], g: mf.Geometry) -> np.ndarray:
        value = np.asarray(embeds["video_latents"], np.float32)
        if value.shape != g.latent_shape:
            raise UserError(f"video_latents has shape {list(value.shape)}, this shape needs {list(g.latent_shape)}")
        return value

    def _noise(self, noise: np.ndarray | None, seed: int, g: mf.Geometry) -> np.ndarray:
        if noise is None:
            return self.initial_latents(seed, g)
        noise = np.asarray(noise, np.float32)
        if noise.shape != g.latent_shape or not np.isfinite(noise).all():
            raise UserError(f"noise must be finite, of shape {list(g.latent_shape)} (got {list(noise.shape)})")
        return noise

    def first_velocity(self, embeds: dict[str, np.ndarray], seed: int = 0, steps: int | None = None,
                       guidance: float | None = None, flow_shift: float | None = None,
                       latents: np.ndarray | None = None, guidance_2: float | None = None, size: Size = None,
                       frames: int | None = None, sampler: str | None = None,
                       sigmas: Sequence[float] | None = None) -> np.ndarray:
        """The guided velocity the DiT predicts at the first of `steps` steps (B, z, T, H/s, W/s), from the one step
        that runs: the scheduler keeps the converted model output m_0 = x_0 - sigma_0 v_0 (runtime/scheduler.py).
        What tools/quality.py compares between two bundles."""
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
        g = self.denoise_shape(embeds, latents, size, frames)
        x0 = np.asarray(self.initial_latents(s.seed, g) if latents is None else latents, np.float32)
        state = self._denoise(embeds, seed, steps, guidance, flow_shift, x0, False, None, guidance_2, None,
                              size=size, frames=frames, stop_after=1, sampler=sampler, sigmas=sigmas)
        sigma0 = float(s.plan(self.scheduler_config).coeffs[0][0])
        return (x0 - state[2]) / sigma0

    def denoise_shape(self, embeds: dict[str, np.ndarray], latents: np.ndarray | None, size: Size = None,
                      frames: int | None = None) -> mf.Geometry:
        """The shape a denoising run makes: that of `latents` (which must agree with `size`/`frames` where given);
        else `size` x `frames`; else, for image conditioning in `embeds`, the shape it was encoded for; else the
        default shape."""
        if latents is not None:
            g = self.shape_of_latents(np.shape(latents))
            if (size is not None or frames is not None) and self.shape(size, frames, g.reference_images) != g:
                raise UserError(f"latents of shape {list(np.shape(latents))} are for {g.describe()}, "
                                f"not the size/frames asked for")
            return g
        by_tensor = {"control": "latent_shape", "video_latents": "latent_shape"}  # (B, C, frames, h, w) says the shape
        for key, attr in by_tensor.items():
            if isinstance(embeds, dict) and key in embeds:
                found = [g for g in self.manifest.shapes if getattr(g, attr)[2:] == tuple(np.shape(embeds[key]))[2:]
                         and (size is None or self.shape(size, frames, g.reference_images).key == g.key)]
                if len(found) == 1 or (found and size is not None):
                    return found[0]
                if len(found) > 1:
                    fits = ", ".join(g.describe() for g in found)
                    raise UserError(f"{key} fits several of this bundle's shapes ({fits}): give size and frames")
        if size is not None or frames is not None or len(self.manifest.shapes) == 1:
            return self.shape(size, frames)
        condition = embeds.get("condition") if isinstance(embeds, dict) else None
        if condition is not None:  # (B, C, T or 1, h, w): "first_frame" kinds' mask says T
            t = np.shape(embeds["mask"])[2] if "mask" in embeds else np.shape(condition)[2]
            h, w = np.shape(condition)[-2:]
            for g in self.manifest.shapes:
                if (g.latent_frames, g.latent_height, g.latent_width) == (t, h, w):
                    return g
        return self.geometry

    # -- decode -------------------------------------------------------------
    def decode(self, latents: np.ndarray, decoder: str = "full") -> np.ndarray:
        """float32 frames (B, F, H, W, 3) in [0, 1], at the shape of the latents (the video's: what `denoise`
        returns). `decoder`: "full" (the VAE) or "tiny" (the bundle's tiny decoder, `export --tiny-decoder`: the same
        latents, several times faster, coarser); both decode one latent frame per call, their memory carried."""
        return self.frame_decoder(decoder)(latents)

    def frame_decoder(self, decoder: str = "full") -> FrameDecoder:
        """A decoder that takes a video's latents a few frames at a time, in order, its memory carried from call to
        call: what the segment loops use to decode each segment's final frames as soon as they are known (the frames
        joined equal one `decode` of all the latents). UserError for a decoder the bundle lacks."""
        return FrameDecoder(self, self.decoder_programs(decoder))

    def _previewer(self, g: mf.Geometry) -> Callable[[Any], np.ndarray] | None:
        """What turns the step programs' state into the live preview's uint8 RGB: the tiny decoder's first-chunk program
        on the middle latent frame of x0 (real frames, at the video's size) where the bundle has one, else the fixed
        latent-to-RGB map (runtime/previews.py), else None (latents it has no map for)."""
        if self.manifest.tiny_decoder is not None:
            return previews.TinyPreviewer(g, self.bundle.call(self._at("tiny_decode_first", g)))
        return previews.Previewer(g) if previews.family(g.latent_channels) else None

    def decoder_programs(self, decoder: str | None) -> str:
        """The chunk programs' prefix of `decoder` ("full", "tiny"; None: "full"); UserError for a name that is
        neither, or "tiny" on a bundle exported without --tiny-decoder."""
        decoder = "full" if decoder is None else decoder
        if decoder not in kinds.DECODERS:
            raise UserError(f"decoder {decoder!r} is not one of {', '.join(kinds.DECODERS)}")
        if decoder == "tiny" and self.manifest.tiny_decoder is None:
            raise UserError("this bundle has no tiny decoder: export it with --tiny-decoder FILE (e.g. "
                            "taew2_1.safetensors), or decode with the full VAE (decoder full)")
        return kinds.DECODERS[decoder]

    def decode_shape(self, shape: tuple[int, ...]) -> mf.Geometry:
        """The bundle shape whose VAE decoder decodes video latents of `shape` (B, z, T, h, w): the one they are the
        video latents of, or (diffusion forcing's videos of any length: the decoder's programs take one latent frame
        at a time) one of their size, if it decodes more than one frame where T does. UserError otherwise."""
        shape = tuple(shape)
        for g in self.manifest.shapes:
            if shape == g.video_latent_shape:
                return g
        if len(shape) == 5:
            for g in self.manifest.shapes:
                b, z, _, h, w = g.video_latent_shape
                if (b, z, h, w) == (shape[0], shape[1], shape[3], shape[4]) and \
                        (shape[2] == 1 or self._at("vae_decode_next", g) in self.manifest.programs):
                    return g
        return self.shape_of_latents(shape, video=True)  # raises, naming the shapes

    def unload_before(self, stage: str) -> None:
        """Drop the weights (and compiled calls) that no program of `stage` or a later stage (kinds.PIPELINE_STAGES)
        uses: before "denoise", the text and image encoders'; before "decode", those and the DiT experts'. A
        one-shot run then peaks at its largest stage rather than their sum; a later call of a dropped stage
        loads it again."""
        if stage not in kinds.PIPELINE_STAGES:
            raise ValueError(f"stage must be one of {kinds.PIPELINE_STAGES}, not {stage!r}")
        later = kinds.PIPELINE_STAGES[kinds.PIPELINE_STAGES.index(stage):]
        programs = self.manifest.programs
        keep = {p.weights for n, p in programs.items() if kinds.pipeline_stage(n) in later}
        self.bundle.unload({p.weights for p in programs.values()} - keep)

    # -- all ----------------------------------------------------------------
    def start_loading(self, image: bool = False, seed: int = 0, steps: int | None = None,
                      guidance: float | None = None, flow_shift: float | None = None, guidance_2: float | None = None,
                      magcache: MagCache | None = None, prompt: str | Sequence[str] | None = None,
                      negative_prompt: str | Sequence[str] = "", size: Size = None, frames: int | None = None,
                      sampler: str | None = None, sigmas: Sequence[float] | None = None,
                      reference_images: int | None = None) -> None:
        """Start loading, in the background, the stages a run with these settings uses before its first step
        (the denoise programs it runs, the image and video encoders only with `image` true: a run with an image or
        a video), so that the DiT's weights are
        read while the prompt is encoded; what `generate` does first. With the `prompt` (and `negative_prompt`),
        the cross-attention programs for its length (`text_rows`); without, the whole text's. The VAE decoder
        loads when it is needed: in the background it would compete with the denoising steps for the cores
        (measured: step 1 done 4 s later on 2 cores). The programs are those of shape `size` x `frames` (with
        `reference_images`, VACE). Raises UserError for bad settings, before any work starts."""
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
        g = self.shape(size, frames, reference_images)
        plan = s.plan(self.scheduler_config)
        denoising = self.step_programs(s.steps, plan.timesteps, s, magcache, g)
        self._timestep_cast(denoising[0], s)  # a sampler the bundle's programs cannot run fails before any work
        rows = None
        if prompt is not None and self.precomputes_kv():
            rows = self._short_rows(self._tokens(prompt, negative_prompt), denoising)
        experts = {self.expert_of(float(t)) for t in plan.timesteps[: s.steps]}
        stage = kinds.pipeline_stage
        self.bundle.prefetch([n for n in self.manifest.programs if stage(n) != "decode"
                              and not kinds.is_text_encoder(n)  # encode loads the one its prompts need, at once
                              and (image or not n.startswith("vae_encode"))
                              and (not kinds.shape_scope(n) or n == self._at(kinds.base_program(n), g))
                              and (not kinds.is_cross_kv(n) or n in {kinds.cross_kv_program(e, rows) for e in experts})
                              and (kinds.denoise_variant(n) is None or n in denoising)])
        for name in dict.fromkeys(denoising):
            if self.manifest.programs[name].blocks is not None:
                self.bundle.prefetch_part(name, "block" if rows is None else f"{mf.SHORT_BLOCK}{rows}")

    def generate(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
                 image: ImageInput | None = None, last_image: ImageInput | None = None, seed: int = 0,
                 steps: int | None = None, guidance: float | None = None, guidance_2: float | None = None,
                 flow_shift: float | None = None, latents: np.ndarray | None = None,
                 progress: bool = True, magcache: MagCache | None = None, low_memory: bool = False,
                 size: Size = None, frames: int | None = None, sampler: str | None = None,
                 sigmas: Sequence[float] | None = None, video: VideoInput | None = None,
                 mask: VideoInput | None = None, reference_images: Sequence[ImageInput] | None = None,
                 conditioning_scale: float | Sequence[float] | None = None, strength: float | None = None,
                 noise: np.ndarray | None = None,
                 on_step: Callable[[int, int], None] | None = None,
                 on_preview: Callable[[np.ndarray], None] | None = None,
                 loras: Sequence[adapters.LoraSpec] | None = None, decoder: str = "full",
                 on_frames: Callable[[np.ndarray], None] | None = None,
                 use_mean_velocity: bool | None = None) -> np.ndarray:
        """prompt (+ image or video) -> frames (B, F, H, W, 3) float32 in [0, 1]. `size` ("WxH") and `frames` pick
        one of the bundle's shapes (`shapes`; the default one where None; a video's frame count picks the frames);
        `latents` is the initial noise, as diffusers' `latents` argument: (B, z, T, H/s, W/s), and picks the shape
        itself. `magcache`: see `denoise`. `sampler` ("unipc", "euler", "dpm++") and `sigmas` (custom noise levels,
        one per step): see `settings`. VACE kinds: `video` (the control or source frames), `mask` (1 = generate,
        0 = keep) and `reference_images` (a list), each optional, and `conditioning_scale`; video-to-video bundles:
        `video`, `strength` and `noise` (see `denoise`). A video is a path (mp4, webm, gif, a folder of numbered
        images), a list of PIL images or an (F, H, W, 3) array (runtime/video_input.py).
        `low_memory`: drop each stage's weights once the run is past it (`unload_before`), as a process making one
        video can: the encoders' before the first step, the DiT's before the VAE decode; the next call loads them
        again. `on_step(done, total)` follows the denoising steps; `on_preview(rgb)` gets each step's estimate of the
        video's middle frame (see `denoise`).

        One bundle shape, one segment: what runtime/front.py's `generate` runs for the kinds without a loop of their
        own (kinds.Kind.loop).

        `decoder`: "full" (the VAE) or "tiny" (the bundle's tiny decoder: `decode`). `on_frames(frames)` gets the
        video once decoded (the segment loops call it for each segment's frames as they are made).

        Flow-map models (AnyFlow): `video`, the first frames to continue (4k+1, fewer than the run makes: kept as
        they are, AnyFlowPipeline's `video`); `use_mean_velocity` as diffusers has it (True: sampler flowmap, the
        default; False: sampler euler, r = t).

        `loras`: the LoRA set this run and the later ones use (`use_loras`: (path or name, scale[, expert]) each; `[]`
        none), switched to before anything runs; None keeps the set the weights hold (the one `runtime.load` was given,
        or the last one a call named). (runtime/front.py's `generate` switches it before any loop.)"""
        self._prompts(prompt, "prompt")  # an empty one fails before any loading starts
        self.decoder_programs(decoder)  # as does a decoder the bundle lacks
        if use_mean_velocity is not None:
            sampler = samplers.mean_velocity_sampler(use_mean_velocity, sampler, self.kind.flow_map)
        if loras is not None:
            self.use_loras(loras)
        kinds.check_videos(self.kind, self.manifest.video_to_video, video, mask, reference_images)
        media = self._load_videos(video, mask, reference_images)
        g = self.denoise_shape({}, latents, size, frames) if latents is not None else \
            self.shape_for_videos(size, frames, *((media["video"], media["references"]) if media else ()))
        size, frames = g.size, g.frames
        self.start_loading(image is not None or media is not None, seed, steps, guidance, flow_shift, guidance_2,
                           magcache, prompt, negative_prompt, size, frames, sampler, sigmas, g.reference_images)
        try:
            embeds = self.encode(prompt, negative_prompt, image, last_image, size, frames,
                                 **({} if media is None else {"video": media["video"], "mask": media["mask"],
                                                              "reference_images": media["references"]}))
            if low_memory:
                self.unload_before("denoise")
            step_done = None
            if on_step is not None:
                total = self.steps_run(embeds, self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler,
                                                             sigmas), strength)

                def step_done(i: int) -> None:
                    on_step(i + 1, total)
            out = self.denoise(embeds, seed, steps, guidance, flow_shift, latents, progress, guidance_2=guidance_2,
                               magcache=magcache, size=size, frames=frames, sampler=sampler, sigmas=sigmas,
                               conditioning_scale=conditioning_scale, strength=strength, noise=noise,
                               on_step=step_done, on_preview=on_preview)
            if low_memory:
                self.unload_before("decode")
            frames = self.decode(out, decoder)
            if on_frames is not None:
                on_frames(frames)
            return frames
        except BaseException:
            self.bundle.cancel_prefetch()
            raise


class FrameDecoder:
    """Latent frames in, video frames out (float32 (B, F, H, W, 3) in [0, 1]), across calls: the decoder's chunk
    programs take one latent frame each and carry their memory (the causal convolutions' caches) on the devices, so a
    video's latents given in parts, in order, decode to the frames one call on all of them makes. The first latent
    frame makes one frame, each later one `temporal_scale`."""

    def __init__(self, pipe: Pipeline, prefix: str) -> None:
        self.pipe, self.prefix = pipe, prefix
        self.shape: mf.Geometry | None = None
        self.caches: Any = None

    def __call__(self, latents: np.ndarray) -> np.ndarray:
        latents = np.asarray(latents, np.float32)
        pipe = self.pipe
        if self.shape is None:
            self.shape = pipe.decode_shape(latents.shape)
            host_memory.release_freed()  # what the denoising steps freed, before the decoder allocates its own
        g, start = self.shape, 0
        pending = None
        if self.caches is None:
            pending, self.caches = pipe.bundle.call(pipe._at(f"{self.prefix}_first", g))(latents[:, :, 0:1])
            start = 1
        chunks = []
        if latents.shape[2] > start:
            nxt = pipe.bundle.call(pipe._at(f"{self.prefix}_next", g))
            for t in range(start, latents.shape[2]):
                frames, self.caches = nxt(latents[:, :, t:t + 1], *self.caches)  # dispatched: runs as the last copies
                # Each chunk comes to the host as the next one runs, so the devices never hold more than two chunks'
                # frames (they come back whole on every device: the 720p x 81 video is 0.9 GB each).
                if pending is not None:
                    chunks.append(fetch(pending).astype(np.float32))
                pending = frames
        if pending is not None:
            chunks.append(fetch(pending).astype(np.float32))
        if not chunks:
            b, _, _, h, w = latents.shape
            return np.zeros((b, 0, h * g.spatial_scale, w * g.spatial_scale, 3), np.float32)
        return np.concatenate(chunks, axis=1)


def _names(prompts: list[str], what: str) -> list[str]:
    """What each prompt of a batch is called in messages: `what`, or "`what` i of B" where they differ."""
    if len(set(prompts)) <= 1:
        return [what] * len(prompts)
    return [f"{what} {i + 1} of {len(prompts)}" for i in range(len(prompts))]


def parse_size(size: Size) -> tuple[int, int]:
    """"WxH" (or "W*H", Wan's spelling) or (width, height) -> (width, height); UserError if it is neither."""
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, (int, np.integer)) for v in size):
        return int(size[0]), int(size[1])
    if isinstance(size, str):
        parts = size.strip().lower().replace("*", "x").split("x")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            return int(parts[0]), int(parts[1])
    raise UserError(f"size {size!r} is not WIDTHxHEIGHT (e.g. 1280x720)")


def load(path: str | Path, verify: bool = True, loras: Sequence[adapters.LoraSpec] | None = None,
         lora_dir: str | Path | None = None) -> Pipeline:
    """Open the bundle at `path` (every file checked against the manifest's sha256). `loras`: adapters made by
    `python -m export --lora`, as (path, scale) pairs (or (path, scale, expert)), merged into the DiT weights as they
    are placed. `lora_dir`: a directory of such adapters, each checked against the bundle now, that `loras` here and
    in `generate(..., loras=...)` / `use_loras` may name (file name without .safetensors; `Pipeline.loras`)."""
    named = adapters.scan(Path(lora_dir), mf.read(Path(path))) if lora_dir is not None else None
    return Pipeline(open_bundle(path, verify=verify, loras=loras, named=named), loras, named)
