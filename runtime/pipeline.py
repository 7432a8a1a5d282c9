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

from . import conditioning, images, kinds, scheduler
from . import manifest as mf
from . import settings as st
from .bundle import Bundle, open_bundle
from .distributed import fetch, is_primary, put
from .errors import UserError
from .kinds import Kind
from .settings import MAX_SEED, DenoiseSettings  # noqa: F401  (public names of this module)
from .text import PromptTokenizer

log = logging.getLogger("runtime")

ImageInput = Any  # a PIL image, a path, or a uint8 (H, W, 3) array (runtime/images.py)


class Pipeline:
    """A loaded bundle. Programs and weights are loaded on first use of each stage."""

    def __init__(self, bundle: Bundle) -> None:
        self.bundle = bundle
        self.manifest: mf.Manifest = bundle.manifest
        self.geometry = self.manifest.geometry
        self.kind: Kind = kinds.get(self.manifest.kind)
        self._tokenizer: PromptTokenizer | None = None
        self.scheduler_config = scheduler.UniPCConfig.from_json(self.manifest.scheduler)

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    def prepare(self) -> None:
        """Place every weight and compile every program (and the noise sampler) now, so the first job
        starts at once: what a server does before it reports ready."""
        self.bundle.prefetch(list(self.manifest.programs))
        for name in self.manifest.programs:
            self.bundle.call(name)
        self.initial_latents(0)

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
               image: ImageInput | None = None, last_image: ImageInput | None = None) -> dict[str, np.ndarray]:
        """Prompt and negative prompt embeddings, float32 (B, L, D), padded positions zero; with an image,
        also its conditioning (`encode_images`)."""
        kinds.check_images(self.kind, image, last_image)
        pil = self._load_images(image, last_image)  # unreadable images fail before any program runs
        prompts = self._prompts(prompt, "prompt") + self._prompts(negative_prompt, "negative_prompt")
        ids, mask = self.tokenizer()(prompts)
        embeds = fetch(self.bundle.call("text_encoder")(ids, mask)).astype(np.float32)
        b = self.geometry.batch
        out = {"prompt_embeds": embeds[:b], "negative_prompt_embeds": embeds[b:]}
        if pil:
            out.update(self._encode_images(*pil))
        return out

    def encode_images(self, image: ImageInput, last_image: ImageInput | None = None) -> dict[str, np.ndarray]:
        """The image conditioning the denoise programs take (the names of kind.denoise_extras), float32:
        `image_embeds` (B x images, tokens, D) from CLIP's penultimate layer; `condition` (VAE latents of
        the image(s), with the frame mask in front for "concat" kinds); `mask` (1, 1, T, h, w) for
        "first_frame" kinds."""
        kinds.check_images(self.kind, image, last_image)
        return self._encode_images(*self._load_images(image, last_image))

    def _load_images(self, image: ImageInput | None, last_image: ImageInput | None) -> list[Any]:
        if image is None:
            return []
        first = images.load_image(image, "image")
        return [first, images.load_image(last_image, "last image") if last_image is not None else None]

    def _encode_images(self, first: Any, last: Any | None) -> dict[str, np.ndarray]:
        chunk = 0
        if "vae_encode_next" in self.manifest.programs:
            chunk = self.manifest.programs["vae_encode_next"].inputs["pixels"].shape[2]
        return conditioning.encode_images(self.kind, self.geometry, self.manifest.image_processor, first, last,
                                          self.bundle.call, fetch, chunk)

    # -- denoise ------------------------------------------------------------
    def settings(self, seed: int = 0, steps: int | None = None, guidance: float | None = None,
                 flow_shift: float | None = None, guidance_2: float | None = None) -> DenoiseSettings:
        return st.resolve(self.manifest.defaults, self.kind, self.scheduler_config, seed, steps, guidance,
                          flow_shift, guidance_2)

    def initial_latents(self, seed: int) -> np.ndarray:
        """float32 N(0, 1) noise from jax.random (torch's generator is not reproduced)."""
        key = jax.random.key(seed)
        return np.asarray(jax.random.normal(key, self.geometry.latent_shape, jnp.float32))

    def expert_of(self, timestep: int) -> int:
        """0 (`transformer`, high noise) where t >= boundary_ratio x num_train_timesteps, else 1 (`transformer_2`)."""
        return st.expert_of(timestep, self.kind, self.manifest.boundary_ratio, self.scheduler_config)

    def _conditioning(self, embeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The denoise programs' extra inputs, from `embeds`; text mode of a "first_frame" kind without one."""
        specs = self.manifest.programs[kinds.denoise_program(0)].inputs
        if self.kind.conditioning == "first_frame" and "condition" not in embeds:  # TI2V as text-to-video
            embeds = {**embeds, **conditioning.text_mode(self.kind, {k: v.shape for k, v in specs.items()})}
        out = []
        for name in self.kind.denoise_extras:
            if name not in embeds:
                raise UserError(f"this bundle is {self.kind.title}: the embeddings have no {name!r}; encode with "
                                "the image (--image / image=...)")
            value = np.asarray(embeds[name], np.float32)
            if value.shape != specs[name].shape:
                raise UserError(f"{name} has shape {list(value.shape)}, this bundle needs {list(specs[name].shape)}")
            if not np.isfinite(value).all():
                raise UserError(f"{name} contains NaN or inf")
            out.append(value)
        return out

    def denoise(self, embeds: dict[str, np.ndarray], seed: int = 0, steps: int | None = None,
                guidance: float | None = None, flow_shift: float | None = None,
                latents: np.ndarray | None = None, progress: bool = True,
                on_step: Callable[[int], None] | None = None, guidance_2: float | None = None) -> np.ndarray:
        """Run the denoising loop; returns float32 latents (B, z, T, H/s, W/s).

        `embeds` is what `encode` returns (prompt embeddings, and the image conditioning for image
        models). Two-expert models switch from `transformer` (with `guidance`) to `transformer_2` (with
        `guidance_2`, default `guidance`) below the boundary timestep, as diffusers does.
        `on_step(i)` is called when step i (0-based) is done and checked finite (e.g. to time it).
        """
        s = self.settings(seed, steps, guidance, flow_shift, guidance_2)
        g = self.geometry
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            if key not in embeds:
                raise UserError(f"embeds has no {key!r}")
            if tuple(np.shape(embeds[key])) != g.embeds_shape:
                raise UserError(f"{key} has shape {list(np.shape(embeds[key]))}, "
                                f"this bundle needs {list(g.embeds_shape)}")
        extras = self._conditioning(embeds)
        if latents is None:
            latents = self.initial_latents(s.seed)
        latents = np.asarray(latents, np.float32)
        if latents.shape != g.latent_shape:
            raise UserError(f"latents have shape {list(latents.shape)}, this bundle needs {list(g.latent_shape)}")
        if not np.isfinite(latents).all():
            raise UserError("initial latents contain NaN or inf")

        plan = scheduler.plan(s.steps, s.flow_shift, self.scheduler_config)
        order = self.scheduler_config.solver_order
        state = np.zeros((scheduler.state_rows(order), *g.latent_shape), np.float32)
        state[0] = latents
        context = np.concatenate([embeds["prompt_embeds"], embeds["negative_prompt_embeds"]]).astype(np.float32)
        programs = [kinds.denoise_program(e) for e in range(self.kind.experts)]
        shardings = self.bundle.input_shardings(programs[0])  # the experts' programs are one file
        # Placed once, shared by the experts.
        state_dev, context_dev = put(state, shardings[0]), put(context, shardings[1])
        extras_dev = [put(x, sh) for x, sh in zip(extras, shardings[5:])]
        guidances = [np.float32(s.guidance_of(e)) for e in range(2)]
        for i in tqdm(range(s.steps), desc="denoising", unit="step", disable=not progress or not is_primary()):
            e = self.expert_of(int(plan.timesteps[i]))
            step = self.bundle.call(programs[e])
            state_dev, finite = step(state_dev, context_dev, plan.timesteps[i], guidances[e], plan.coeffs[i],
                                     *extras_dev)
            if not bool(fetch(finite)):
                raise UserError(f"non-finite values (NaN/inf) appeared in the latents at denoising step {i + 1} of "
                                f"{s.steps}: check the weights, guidance ({guidances[e]}) and dtype")
            if on_step is not None:
                on_step(i)
        out = fetch(state_dev)[0].astype(np.float32)
        return conditioning.restore_first_frame(self.kind, dict(zip(self.kind.denoise_extras, extras)), out)

    # -- decode -------------------------------------------------------------
    def decode(self, latents: np.ndarray) -> np.ndarray:
        """float32 frames (B, F, H, W, 3) in [0, 1]."""
        g = self.geometry
        latents = np.asarray(latents, np.float32)
        if latents.shape != g.latent_shape:
            raise UserError(f"latents have shape {list(latents.shape)}, this bundle needs {list(g.latent_shape)}")
        first = self.bundle.call("vae_decode_first")
        frames, caches = first(latents[:, :, 0:1])
        chunks = [frames]
        if g.latent_frames > 1:
            nxt = self.bundle.call("vae_decode_next")
            for t in range(1, g.latent_frames):
                frames, caches = nxt(latents[:, :, t:t + 1], *caches)
                chunks.append(frames)
        return np.concatenate([fetch(c).astype(np.float32) for c in chunks], axis=1)

    # -- all ----------------------------------------------------------------
    def generate(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "",
                 image: ImageInput | None = None, last_image: ImageInput | None = None, seed: int = 0,
                 steps: int | None = None, guidance: float | None = None, guidance_2: float | None = None,
                 flow_shift: float | None = None, latents: np.ndarray | None = None,
                 progress: bool = True) -> np.ndarray:
        """prompt (+ image) -> frames (B, F, H, W, 3) float32 in [0, 1]. `latents` is the initial noise, as
        diffusers' `latents` argument: (B, z, T, H/s, W/s)."""
        self.settings(seed, steps, guidance, flow_shift, guidance_2)  # fail before encoding
        # The stages before the first step start loading now, so the DiT's weights are read while the prompt is
        # encoded. The VAE decoder loads when it is needed: in the background it would compete with the
        # denoising steps for the cores (measured: step 1 done 4 s later on 2 cores).
        self.bundle.prefetch([n for n in self.manifest.programs if not n.startswith("vae_decode")
                              and (image is not None or not n.startswith("vae_encode"))])
        try:
            embeds = self.encode(prompt, negative_prompt, image, last_image)
            out = self.denoise(embeds, seed, steps, guidance, flow_shift, latents, progress, guidance_2=guidance_2)
            return self.decode(out)
        except BaseException:
            self.bundle.cancel_prefetch()
            raise


def load(path: str | Path, verify: bool = True) -> Pipeline:
    """Open the bundle at `path` (every file checked against the manifest's sha256)."""
    return Pipeline(open_bundle(path, verify=verify))
