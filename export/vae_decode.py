"""Stage `vae_decode`: de-normalise latents, decode one latent frame at a time, clamp.

diffusers decodes a latent frame per call with a Python-list feature cache (two
frames per causal conv). We export two programs: `vae_decode_first` (latent frame
0, empty cache) and `vae_decode_next` (any later frame), with every cache entry an
explicit 2-frame input/output. A zero-filled 2-frame cache is exactly what the
causal zero padding would give, so frame 1 onward all share one program, and
compile time and memory do not grow with the frame count.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.manifest import TensorSpec


def decoder_module(vae: Any) -> Any:
    """The part of AutoencoderKLWan that decoding needs; parameter names match the checkpoint."""
    import torch

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.post_quant_conv = vae.post_quant_conv
            self.decoder = vae.decoder

        def forward(self, z: Any, caches: list[Any] | None) -> tuple[Any, list[Any]]:
            feat = [None] * n_caches(vae) if caches is None else list(caches)
            x = self.post_quant_conv(z)
            out = self.decoder(x, feat_cache=feat, feat_idx=[0], first_chunk=caches is None)
            return torch.clamp(out, min=-1.0, max=1.0), feat

    return Decoder().eval()


def n_caches(vae: Any) -> int:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())


def cache_specs(vae: Any, latent_hw: tuple[int, int], batch: int) -> list[TensorSpec | None]:
    """Shapes of the 2-frame caches after frame 1, found by running the decoder on `meta` tensors.

    Slots that the decoder never fills (1x1x1 shortcut convs) are None and are not program inputs.
    """
    import torch

    meta = decoder_module(copy.deepcopy(vae).to("meta"))
    z = torch.empty((batch, vae.config.z_dim, 1, *latent_hw), device="meta")
    with torch.no_grad():
        _, feat = meta(z, None)
        _, feat = meta(z, feat)
    specs = []
    for entry in feat:
        if entry is None:
            specs.append(None)
            continue
        if not isinstance(entry, torch.Tensor) or entry.shape[2] != 2:
            raise AssertionError(f"unexpected VAE cache entry after frame 1: {entry!r}")
        specs.append(TensorSpec(tuple(entry.shape), "float32"))
    return specs


def _normalise(feat: list[Any], specs: list[TensorSpec | None]) -> list[jax.Array]:
    """Turn diffusers' cache list into 2-frame arrays ("Rep" and 1-frame entries are zero-padded)."""
    out = []
    for entry, spec in zip(feat, specs):
        if spec is None:
            continue
        if isinstance(entry, str):  # "Rep": upsampler not primed yet, i.e. all zeros
            out.append(jnp.zeros(spec.shape, jnp.float32))
            continue
        entry = jnp.asarray(entry, jnp.float32)
        if entry.shape[2] == 1:
            entry = jnp.concatenate([jnp.zeros_like(entry), entry], axis=2)
        out.append(entry)
    return out


def build(vae: Any, extracted_fn: Callable[..., Any], specs: list[TensorSpec | None], first: bool
          ) -> Callable[..., tuple[jax.Array, list[jax.Array]]]:
    """fn(weights, latents (B, C, 1, h, w) float32[, caches]) -> (frames (B, F, H, W, 3) in [0, 1], caches)."""
    mean = np.asarray(vae.config.latents_mean, np.float32).reshape(1, -1, 1, 1, 1)
    inv_std = (1.0 / np.asarray(vae.config.latents_std, np.float32)).reshape(1, -1, 1, 1, 1)

    def decode(weights: dict[str, Any], latents: jax.Array, *caches: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        z = latents / inv_std + mean  # diffusers: latents / (1 / std) + mean
        slots: list[Any] | None = None
        if not first:
            it = iter(caches)
            slots = [None if spec is None else next(it) for spec in specs]
        out, feat = extracted_fn(weights, (z, slots), {})
        frames = jnp.clip(out * 0.5 + 0.5, 0.0, 1.0)
        return jnp.transpose(frames, (0, 2, 3, 4, 1)), _normalise(feat, specs)

    return decode
