"""encode -> denoise -> decode on a bundle, with no torch anywhere."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from . import conditioning, host_memory, images, kinds, scheduler, signatures
from . import magcache as magcache_rule
from . import manifest as mf
from . import settings as st
from .bundle import Bundle, open_bundle
from .distributed import fetch, is_primary, put
from .errors import UserError
from .kinds import Kind
from .magcache import MagCache
from .settings import MAX_SEED, DenoiseSettings  # noqa: F401  (public names of this module)
from .text import PromptTokenizer

log = logging.getLogger("runtime")

ImageInput = Any  # a PIL image, a path, or a uint8 (H, W, 3) array (runtime/images.py)


Size = str | tuple[int, int] | None  # "WxH" or (width, height); None: the default shape's


class Pipeline:
    """A loaded bundle. Programs and weights are loaded on first use of each stage.

    A bundle makes one or more shapes (width x height x frames, `shapes`; the first is the default): one copy of
    the weights, programs per shape. `generate`, `encode`, `denoise` and `calibrate` take `size=` and `frames=`
    (a shape the bundle lacks is a UserError listing those it has); `denoise` and `decode` take the shape of the
    latents they are given."""

    def __init__(self, bundle: Bundle) -> None:
        self.bundle = bundle
        self.manifest: mf.Manifest = bundle.manifest
        self.geometry = self.manifest.geometry  # the default shape
        self.kind: Kind = kinds.get(self.manifest.kind)
        self._tokenizer: PromptTokenizer | None = None
        self.scheduler_config = scheduler.UniPCConfig.from_json(self.manifest.scheduler)

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The (width, height, frames) this bundle makes, the default first."""
        return [g.shape for g in self.manifest.shapes]

    def shape(self, size: Size = None, frames: int | None = None) -> mf.Geometry:
        """The bundle's shape of this size ("WxH" or (width, height)) and frame count; what is None is the default
        shape's (or, for a size whose shapes lack the default's frames, that size's first). UserError naming the
        bundle's shapes if it has none such."""
        d = self.geometry
        width, height = parse_size(size) if size is not None else (d.width, d.height)
        if frames is not None and (isinstance(frames, bool) or not isinstance(frames, (int, np.integer))):
            raise UserError(f"frames must be an integer, got {frames!r}")
        g = self.manifest.find_shape(width, height, d.frames if frames is None else int(frames))
        if g is None and frames is None:
            g = self.manifest.find_shape(width, height)
        if g is None:
            asked = f"{width}x{height} x {frames if frames is not None else d.frames} frames"
            raise UserError(f"this bundle makes no {asked} video: its shapes are {self.manifest.shapes_text()} "
                            "(export one with --resolution/--frames for others)")
        return g

    def shape_of_latents(self, shape: tuple[int, ...]) -> mf.Geometry:
        """The bundle's shape whose latents have this shape; UserError naming the shapes if none."""
        for g in self.manifest.shapes:
            if tuple(shape) == g.latent_shape:
                return g
        want = ", ".join(f"{list(g.latent_shape)} ({g.size} x {g.frames} frames)" for g in self.manifest.shapes)
        raise UserError(f"latents have shape {list(shape)}, this bundle needs one of {want}")

    def _at(self, program: str, g: mf.Geometry) -> str:
        """The name of program `program` (as kinds names it) for shape `g`."""
        return self.manifest.program_for(program, g)

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
            return [prompt] * b
        prompts = list(prompt) if isinstance(prompt, (list, tuple)) else []
        if len(prompts) != b or not all(isinstance(p, str) for p in prompts):
            raise UserError(f"{what} must be a string or a list of {b} strings (the bundle's batch size)")
        return prompts

    def encode(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
               image: ImageInput | None = None, last_image: ImageInput | None = None, size: Size = None,
               frames: int | None = None) -> dict[str, np.ndarray]:
        """Prompt and negative prompt embeddings, float32 (B, L, D), padded positions zero; with an image,
        also its conditioning (`encode_images`) for the shape `size` x `frames` (the default shape's if None)."""
        kinds.check_images(self.kind, image, last_image)
        g = self.shape(size, frames)
        pil = self._load_images(image, last_image)  # unreadable images fail before any program runs
        prompts = self._prompts(prompt, "prompt") + self._prompts(negative_prompt, "negative_prompt")
        ids, mask = self.tokenizer()(prompts)
        n = self._text_length(int(mask.sum(axis=1).max()))
        name = kinds.text_encoder_program(n, self.geometry.max_sequence_length)
        embeds = fetch(self.bundle.call(name)(ids[:, :n], mask[:, :n])).astype(np.float32)
        embeds = np.pad(embeds, ((0, 0), (0, ids.shape[1] - n), (0, 0)))  # padded positions are zero
        b = self.geometry.batch
        out = {"prompt_embeds": embeds[:b], "negative_prompt_embeds": embeds[b:]}
        if pil:
            out.update(self._encode_images(g, *pil))
        return out

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
        chunk = 0
        if self._at("vae_encode_next", g) in self.manifest.programs:
            chunk = self.manifest.programs[self._at("vae_encode_next", g)].inputs["pixels"].shape[2]
        return conditioning.encode_images(self.kind, g, self.manifest.image_processor, first, last,
                                          lambda name: self.bundle.call(self._at(name, g)), fetch, chunk)

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
        """The timestep as program `program` takes it: float32 (bundles of schema 9 on), or int32 in older bundles,
        whose programs cannot take Euler's fractional timesteps (UserError, before any work)."""
        if self.manifest.programs[program].inputs["timestep"].dtype == "float32":
            return np.float32
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

    def _conditioning(self, embeds: dict[str, np.ndarray], g: mf.Geometry) -> dict[str, np.ndarray]:
        """The image inputs of the denoise (and cross_kv) programs of shape `g`, by name (kind.denoise_extras), from
        `embeds`; text mode of a "first_frame" kind without one."""
        programs = self.manifest.programs
        specs = dict(programs[self._at(kinds.denoise_program(0), g)].inputs)
        if self.precomputes_kv():
            specs.update(programs[kinds.cross_kv_program(0)].inputs)
        if self.kind.conditioning == "first_frame" and "condition" not in embeds:  # TI2V as text-to-video
            embeds = {**embeds, **conditioning.text_mode(self.kind, {k: v.shape for k, v in specs.items()})}
        out = {}
        for name in self.kind.denoise_extras:
            if name not in embeds:
                raise UserError(f"this bundle is {self.kind.title}: the embeddings have no {name!r}; encode with "
                                "the image (--image / image=...)")
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
                sampler: str | None = None, sigmas: Sequence[float] | None = None) -> np.ndarray:
        """Run the denoising loop; returns float32 latents (B, z, T, H/s, W/s).

        The shape is that of `latents` if given; else `size` x `frames`; else, with image conditioning in `embeds`,
        the shape it was encoded for; else the default shape.

        `embeds` is what `encode` returns (prompt embeddings, and the image conditioning for image
        models). Two-expert models switch from `transformer` (with `guidance`) to `transformer_2` (with
        `guidance_2`, default `guidance`) below the boundary timestep, as diffusers does. Steps whose
        guidance is <= 1 run the DiT on the prompt alone. `magcache` skips the transformer blocks on the
        steps its schedule says (runtime/magcache.py). `sampler` and `sigmas`: see `settings`.
        `on_step(i)` is called when step i (0-based) is done and checked finite (e.g. to time it).
        """
        return self._denoise(embeds, seed, steps, guidance, flow_shift, latents, progress, on_step, guidance_2,
                             magcache, size=size, frames=frames, sampler=sampler, sigmas=sigmas)

    def calibrate(self, embeds: dict[str, np.ndarray], seed: int = 0, steps: int | None = None,
                  guidance: float | None = None, flow_shift: float | None = None, latents: np.ndarray | None = None,
                  progress: bool = True, guidance_2: float | None = None, size: Size = None,
                  frames: int | None = None, sampler: str | None = None,
                  sigmas: Sequence[float] | None = None) -> list[float]:
        """MagCache's ratios for this bundle and these settings, as diffusers' calibration mode computes them:
        every step runs in full; step i's ratio is the mean over tokens of |residual_i| / |residual_i-1| on the
        prompt (cond) half, 1.0 on each expert's first step."""
        ratios: list[float] = []
        everything = MagCache([1.0], threshold=0.0, max_skip_steps=0, retention_ratio=1.0)  # never skips
        self._denoise(embeds, seed, steps, guidance, flow_shift, latents, progress, None, guidance_2, everything,
                      calibration=ratios, size=size, frames=frames, sampler=sampler, sigmas=sigmas)
        return ratios

    def _denoise(self, embeds: dict[str, np.ndarray], seed: int, steps: int | None, guidance: float | None,
                 flow_shift: float | None, latents: np.ndarray | None, progress: bool,
                 on_step: Callable[[int], None] | None, guidance_2: float | None, magcache: MagCache | None,
                 calibration: list[float] | None = None, size: Size = None, frames: int | None = None,
                 stop_after: int | None = None, sampler: str | None = None,
                 sigmas: Sequence[float] | None = None) -> np.ndarray:
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
        if magcache is not None and not isinstance(magcache, MagCache):
            raise UserError("magcache must be a runtime.MagCache (e.g. MagCache(ratios=[...]))")
        g = self.denoise_shape(embeds, latents, size, frames)
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            if key not in embeds:
                raise UserError(f"embeds has no {key!r}")
            if tuple(np.shape(embeds[key])) != g.embeds_shape:
                raise UserError(f"{key} has shape {list(np.shape(embeds[key]))}, "
                                f"this bundle needs {list(g.embeds_shape)}")
        extras = self._conditioning(embeds, g)
        if latents is None:
            latents = self.initial_latents(s.seed, g)
        latents = np.asarray(latents, np.float32)
        if not np.isfinite(latents).all():
            raise UserError("initial latents contain NaN or inf")

        plan = s.plan(self.scheduler_config)
        programs = self.step_programs(s.steps, plan.timesteps, s, magcache, g)
        timestep_of = self._timestep_cast(programs[0], s)
        order = self.scheduler_config.solver_order
        state = np.zeros((scheduler.state_rows(order), *g.latent_shape), np.float32)
        state[0] = latents
        prompt = np.asarray(embeds["prompt_embeds"], np.float32)
        contexts = {True: np.concatenate([prompt, embeds["negative_prompt_embeds"]]).astype(np.float32),
                    False: prompt}
        with_kv = self.precomputes_kv()
        rows = self.text_rows(contexts[True], programs) if with_kv else None
        step_extras = self.kind.conditioning_inputs if with_kv else self.kind.denoise_extras
        # The state and conditioning are placed once (as the first program wants them; the variants share their
        # layout) and shared by the experts.
        first = dict(zip(self._inputs(programs[0]), self.bundle.call_shardings(programs[0]), strict=True))
        state_dev = put(state, first["state"])
        extras_dev = {n: put(extras[n], first[n]) for n in step_extras}
        contexts_dev: dict[Any, Any] = {}  # context by cfg (older bundles), or keys and values by expert
        guidances = [np.float32(s.guidance_of(e)) for e in range(2)]
        residual = norms = None
        expert_before = -1
        for i in tqdm(range(s.steps), desc="denoising", unit="step", disable=not progress or not is_primary()):
            name = programs[i]
            variant = kinds.denoise_variant(name)
            e = self.expert_of(float(plan.timesteps[i]))
            text = ("kv", e) if with_kv else variant.cfg
            if text not in contexts_dev:
                if with_kv:  # once per prompt and expert: every step's cross-attention keys and values
                    context = contexts[True] if rows is None else contexts[True][:, :rows]
                    kv_inputs = [context, *[extras[n] for n in self.kind.kv_inputs[1:]]]
                    contexts_dev[text] = self.bundle.call(kinds.cross_kv_program(e, rows))(*kv_inputs)
                else:
                    contexts_dev[text] = put(contexts[variant.cfg], self.bundle.input_shardings(name)[1])
            values = {"state": state_dev, "kv": contexts_dev[text], "context": contexts_dev[text],
                      "timestep": timestep_of(plan.timesteps[i]), "guidance": guidances[e], "row": plan.coeffs[i],
                      **extras_dev, "residual": residual}
            outs = self.bundle.call(name)(*[values[n] for n in self._inputs(name)])
            state_dev, finite = outs[0], outs[1]
            if variant.residual == "out":
                residual = outs[2]
            if not bool(fetch(finite)):
                raise UserError(f"non-finite values (NaN/inf) appeared in the latents at denoising step {i + 1} of "
                                f"{s.steps}: check the weights, guidance ({guidances[e]}) and dtype")
            if calibration is not None:
                now = fetch(jnp.linalg.norm(residual[: g.batch].astype(jnp.float32), axis=-1))
                calibration.append(magcache_rule.calibration_ratio(now, norms if e == expert_before else None))
                norms, expert_before = now, e
            if on_step is not None:
                on_step(i)
            if stop_after is not None and i + 1 == stop_after:
                return fetch(state_dev).astype(np.float32)  # every row of the scheduler's state
        out = fetch(state_dev)[0].astype(np.float32)
        return conditioning.restore_first_frame(self.kind, extras, out)

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
            if (size is not None or frames is not None) and self.shape(size, frames) != g:
                raise UserError(f"latents of shape {list(np.shape(latents))} are for {g.size} x {g.frames} frames, "
                                f"not the size/frames asked for")
            return g
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
    def decode(self, latents: np.ndarray) -> np.ndarray:
        """float32 frames (B, F, H, W, 3) in [0, 1], at the shape of the latents."""
        latents = np.asarray(latents, np.float32)
        g = self.shape_of_latents(latents.shape)
        host_memory.release_freed()  # what the denoising steps freed, before the decoder allocates its own
        first = self.bundle.call(self._at("vae_decode_first", g))
        frames, caches = first(latents[:, :, 0:1])
        chunks = [frames]
        if g.latent_frames > 1:
            nxt = self.bundle.call(self._at("vae_decode_next", g))
            for t in range(1, g.latent_frames):
                frames, caches = nxt(latents[:, :, t:t + 1], *caches)
                chunks.append(frames)
        return np.concatenate([fetch(c).astype(np.float32) for c in chunks], axis=1)

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
                      sampler: str | None = None, sigmas: Sequence[float] | None = None) -> None:
        """Start loading, in the background, the stages a run with these settings uses before its first step
        (the denoise programs it runs, the image encoders only with an `image`), so that the DiT's weights are
        read while the prompt is encoded; what `generate` does first. With the `prompt` (and `negative_prompt`),
        the cross-attention programs for its length (`text_rows`); without, the whole text's. The VAE decoder
        loads when it is needed: in the background it would compete with the denoising steps for the cores
        (measured: step 1 done 4 s later on 2 cores). The programs are those of shape `size` x `frames`. Raises
        UserError for bad settings, before any work starts."""
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2, sampler, sigmas)
        g = self.shape(size, frames)
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
                 sigmas: Sequence[float] | None = None) -> np.ndarray:
        """prompt (+ image) -> frames (B, F, H, W, 3) float32 in [0, 1]. `size` ("WxH") and `frames` pick one of the
        bundle's shapes (`shapes`; the default one where None); `latents` is the initial noise, as diffusers'
        `latents` argument: (B, z, T, H/s, W/s), and picks the shape itself. `magcache`: see `denoise`. `sampler`
        ("unipc", "euler", "dpm++") and `sigmas` (custom noise levels, one per step): see `settings`.
        `low_memory`: drop each stage's weights once the run is past it (`unload_before`), as a process making one
        video can: the encoders' before the first step, the DiT's before the VAE decode; the next call loads them
        again."""
        g = self.denoise_shape({}, latents, size, frames)
        size, frames = g.size, g.frames
        self.start_loading(image is not None, seed, steps, guidance, flow_shift, guidance_2, magcache, prompt,
                           negative_prompt, size, frames, sampler, sigmas)
        try:
            embeds = self.encode(prompt, negative_prompt, image, last_image, size, frames)
            if low_memory:
                self.unload_before("denoise")
            out = self.denoise(embeds, seed, steps, guidance, flow_shift, latents, progress, guidance_2=guidance_2,
                               magcache=magcache, size=size, frames=frames, sampler=sampler, sigmas=sigmas)
            if low_memory:
                self.unload_before("decode")
            return self.decode(out)
        except BaseException:
            self.bundle.cancel_prefetch()
            raise


def parse_size(size: Size) -> tuple[int, int]:
    """"WxH" (or "W*H", Wan's spelling) or (width, height) -> (width, height); UserError if it is neither."""
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, (int, np.integer)) for v in size):
        return int(size[0]), int(size[1])
    if isinstance(size, str):
        parts = size.strip().lower().replace("*", "x").split("x")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            return int(parts[0]), int(parts[1])
    raise UserError(f"size {size!r} is not WIDTHxHEIGHT (e.g. 1280x720)")


def load(path: str | Path, verify: bool = True, loras: list[tuple[str | Path, float]] | None = None) -> Pipeline:
    """Open the bundle at `path` (every file checked against the manifest's sha256). `loras`: adapters made by
    `python -m export --lora`, as (path, scale) pairs, merged into the DiT weights as they are placed."""
    return Pipeline(open_bundle(path, verify=verify, loras=loras))
