"""encode -> denoise -> decode on a bundle, with no torch anywhere."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from . import manifest as mf
from . import scheduler
from .bundle import Bundle, open_bundle
from .distributed import fetch, is_primary, put
from .errors import UserError
from .text import PromptTokenizer

log = logging.getLogger("runtime")

MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class DenoiseSettings:
    seed: int
    steps: int
    guidance: float
    flow_shift: float

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps": self.steps, "guidance": self.guidance, "flow_shift": self.flow_shift}


class Pipeline:
    """A loaded bundle. Programs and weights are loaded on first use of each stage."""

    def __init__(self, bundle: Bundle) -> None:
        self.bundle = bundle
        self.manifest: mf.Manifest = bundle.manifest
        self.geometry = self.manifest.geometry
        self._tokenizer: PromptTokenizer | None = None
        self.scheduler_config = scheduler.UniPCConfig.from_json(self.manifest.scheduler)

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    # -- text ---------------------------------------------------------------
    def tokenizer(self) -> PromptTokenizer:
        if self._tokenizer is None:
            path = mf.resolve(self.bundle.path, self.manifest.tokenizer.file)
            self._tokenizer = PromptTokenizer.from_file(path, self.geometry.max_sequence_length)
        return self._tokenizer

    def _prompts(self, prompt: str | Sequence[str], what: str) -> list[str]:
        b = self.geometry.batch
        if isinstance(prompt, str):
            return [prompt] * b
        prompts = list(prompt)
        if len(prompts) != b or not all(isinstance(p, str) for p in prompts):
            raise UserError(f"{what} must be a string or a list of {b} strings (the bundle's batch size)")
        return prompts

    def encode(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "") -> dict[str, np.ndarray]:
        """Prompt and negative prompt embeddings, float32 (B, L, D), padded positions zero."""
        prompts = self._prompts(prompt, "prompt") + self._prompts(negative_prompt, "negative_prompt")
        ids, mask = self.tokenizer()(prompts)
        embeds = fetch(self.bundle.call("text_encoder")(ids, mask)).astype(np.float32)
        b = self.geometry.batch
        return {"prompt_embeds": embeds[:b], "negative_prompt_embeds": embeds[b:]}

    # -- denoise ------------------------------------------------------------
    def settings(self, seed: int = 0, steps: int | None = None, guidance: float | None = None,
                 flow_shift: float | None = None) -> DenoiseSettings:
        d = self.manifest.defaults
        steps = d.steps if steps is None else steps
        guidance = d.guidance if guidance is None else guidance
        flow_shift = d.flow_shift if flow_shift is None else flow_shift
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise UserError(f"steps must be an integer >= 1, got {steps!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
            raise UserError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
        if not isinstance(guidance, (int, float)) or not math.isfinite(guidance) or guidance < 0:
            raise UserError(f"guidance must be a finite number >= 0, got {guidance!r}")
        if not isinstance(flow_shift, (int, float)) or not math.isfinite(flow_shift) or flow_shift <= 0:
            raise UserError(f"flow shift must be a finite number > 0, got {flow_shift!r}")
        return DenoiseSettings(int(seed), int(steps), float(guidance), float(flow_shift))

    def initial_latents(self, seed: int) -> np.ndarray:
        """float32 N(0, 1) noise from jax.random (torch's generator is not reproduced)."""
        key = jax.random.key(seed)
        return np.asarray(jax.random.normal(key, self.geometry.latent_shape, jnp.float32))

    def denoise(self, embeds: dict[str, np.ndarray], seed: int = 0, steps: int | None = None,
                guidance: float | None = None, flow_shift: float | None = None,
                latents: np.ndarray | None = None, progress: bool = True,
                on_step: Callable[[int], None] | None = None) -> np.ndarray:
        """Run the denoising loop; returns float32 latents (B, C, T, H/8, W/8).

        `on_step(i)` is called when step i (0-based) is done and checked finite (e.g. to time it).
        """
        s = self.settings(seed, steps, guidance, flow_shift)
        g = self.geometry
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            if key not in embeds:
                raise UserError(f"embeds has no {key!r}")
            if tuple(np.shape(embeds[key])) != g.embeds_shape:
                raise UserError(f"{key} has shape {list(np.shape(embeds[key]))}, "
                                f"this bundle needs {list(g.embeds_shape)}")
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
        step = self.bundle.call("denoise_step")
        shardings = self.bundle.input_shardings("denoise_step")
        state_dev, context_dev = put(state, shardings[0]), put(context, shardings[1])  # placed once
        guidance = np.float32(s.guidance)
        for i in tqdm(range(s.steps), desc="denoising", unit="step", disable=not progress or not is_primary()):
            state_dev, finite = step(state_dev, context_dev, plan.timesteps[i], guidance, plan.coeffs[i])
            if not bool(fetch(finite)):
                raise UserError(f"non-finite values (NaN/inf) appeared in the latents at denoising step {i + 1} of "
                                f"{s.steps}: check the weights, guidance ({s.guidance}) and dtype")
            if on_step is not None:
                on_step(i)
        return fetch(state_dev)[0].astype(np.float32)

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
    def generate(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "", seed: int = 0,
                 steps: int | None = None, guidance: float | None = None, flow_shift: float | None = None,
                 latents: np.ndarray | None = None, progress: bool = True) -> np.ndarray:
        self.settings(seed, steps, guidance, flow_shift)  # fail before encoding
        embeds = self.encode(prompt, negative_prompt)
        out = self.denoise(embeds, seed, steps, guidance, flow_shift, latents, progress)
        return self.decode(out)


def load(path: str | Path, verify: bool = True) -> Pipeline:
    """Open the bundle at `path` (every file checked against the manifest's sha256)."""
    return Pipeline(open_bundle(path, verify=verify))
