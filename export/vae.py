"""Stages `vae_encode_*` and `vae_decode_*`: the Wan VAE one chunk at a time, caches as explicit arguments.

diffusers runs the causal VAE chunk by chunk with a Python-list feature cache (the
last frames each causal conv saw). We export two programs per direction: `*_first`
(the first chunk, empty cache) and `*_next` (any later chunk), with every cache slot
an explicit fixed-shape input/output. A cache entry shorter than its slot is padded
with leading zeros, which is exactly what the causal zero padding would have given
(and temporal downsamplers read only the last frame), so every later chunk shares
one program and compile time and memory do not grow with the frame count.

Chunks: decode takes one latent frame (-> 1 frame first, 4 after); encode takes 1
frame first and 4 after (-> one latent frame each). The Wan 2.2 VAE (patch_size 2)
patchifies before the encoder and unpatchifies after the decoder, inside the programs.
Encoding returns the distribution mean (diffusers' sample_mode="argmax"), normalised
as the I2V pipelines do; decoding de-normalises, clamps and returns frames in [0, 1].
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.manifest import TensorSpec

FIRST, NEXT = "first", "next"
ENCODE_CHUNK = 4  # pixel frames per later encode chunk (one latent frame)


def module(vae: Any, encode: bool) -> Any:
    """The parts of AutoencoderKLWan a bundle needs (parameter names match the checkpoint); the
    encoder only when the model kind encodes images."""
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify

    patch = vae.config.patch_size
    z_dim = vae.config.z_dim

    class Parts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.post_quant_conv = vae.post_quant_conv
            self.decoder = vae.decoder
            if encode:
                self.encoder = vae.encoder
                self.quant_conv = vae.quant_conv

        def forward(self, z: Any, caches: list[Any] | None) -> tuple[Any, list[Any]]:
            """Decode one latent frame -> (pixels in [-1, 1], caches)."""
            feat = [None] * n_caches(vae.decoder) if caches is None else list(caches)
            x = self.post_quant_conv(z)
            out = self.decoder(x, feat_cache=feat, feat_idx=[0], first_chunk=caches is None)
            if patch is not None:
                out = unpatchify(out, patch_size=patch)
            return torch.clamp(out, min=-1.0, max=1.0), feat

        def encode(self, x: Any, caches: list[Any] | None) -> tuple[Any, list[Any]]:
            """Encode one chunk of pixels in [-1, 1] -> (latent mean, caches)."""
            feat = [None] * n_caches(vae.encoder) if caches is None else list(caches)
            if patch is not None:
                x = patchify(x, patch_size=patch)
            out = self.quant_conv(self.encoder(x, feat_cache=feat, feat_idx=[0]))  # 1x1x1: chunkwise is exact
            return out[:, :z_dim], feat

    return Parts().eval()


def n_caches(part: Any) -> int:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in part.modules())


def chunk_shape(vae: Any, direction: str, which: str, batch: int, height: int, width: int) -> tuple[int, ...]:
    """The input of one chunk program: latents (B, z, 1, h, w) to decode, pixels (B, 3, f, H, W) to encode
    (height/width are latent sizes for decode and pixel sizes for encode)."""
    if direction == "decode":
        return (batch, vae.config.z_dim, 1, height, width)
    return (batch, 3, 1 if which == FIRST else ENCODE_CHUNK, height, width)


def cache_specs(vae: Any, direction: str, batch: int, height: int, width: int) -> list[TensorSpec | None]:
    """Shapes of the cache slots a later chunk takes, found by running three chunks on `meta` tensors.

    Slots never filled (1x1x1 shortcut convs) are None and are not program inputs. The
    second and third chunks must leave caches of the same shapes: that is what lets one
    `*_next` program serve every later chunk.
    """
    import torch

    parts = module(copy.deepcopy(vae).to("meta"), encode=direction == "encode")
    run = parts.forward if direction == "decode" else parts.encode

    def x(which: str) -> Any:
        return torch.empty(chunk_shape(vae, direction, which, batch, height, width), device="meta")

    with torch.no_grad():
        _, feat = run(x(FIRST), None)
        _, feat = run(x(NEXT), feat)
        after_second = [_frames_shape(e) for e in feat]
        _, feat = run(x(NEXT), feat)
    if [_frames_shape(e) for e in feat] != after_second:
        raise AssertionError(f"VAE {direction} caches change shape between later chunks: {after_second}")
    return [None if s is None else TensorSpec(s, "float32") for s in after_second]


def _frames_shape(entry: Any) -> tuple[int, ...] | None:
    import torch

    if entry is None:
        return None
    if not isinstance(entry, torch.Tensor):
        raise AssertionError(f"unexpected VAE cache entry after a later chunk: {entry!r}")
    return tuple(int(s) for s in entry.shape)


def _normalise(feat: list[Any], specs: list[TensorSpec | None]) -> list[jax.Array]:
    """diffusers' cache list as fixed-shape arrays: "Rep" (an unprimed upsampler) is zeros, and shorter
    entries get leading zero frames."""
    out = []
    for entry, spec in zip(feat, specs):
        if spec is None:
            continue
        if entry is None or isinstance(entry, str):
            out.append(jnp.zeros(spec.shape, jnp.float32))
            continue
        entry = jnp.asarray(entry, jnp.float32)
        missing = spec.shape[2] - entry.shape[2]
        if missing:
            entry = jnp.concatenate([jnp.zeros((*entry.shape[:2], missing, *entry.shape[3:]), jnp.float32), entry],
                                    axis=2)
        out.append(entry)
    return out


def _latent_stats(vae: Any) -> tuple[np.ndarray, np.ndarray]:
    mean = np.asarray(vae.config.latents_mean, np.float32).reshape(1, -1, 1, 1, 1)
    inv_std = (1.0 / np.asarray(vae.config.latents_std, np.float32)).reshape(1, -1, 1, 1, 1)
    return mean, inv_std


def _slots(caches: tuple[jax.Array, ...], specs: list[TensorSpec | None]) -> list[Any]:
    it = iter(caches)
    return [None if spec is None else next(it) for spec in specs]


def build_decode(vae: Any, extracted_fn: Callable[..., Any], specs: list[TensorSpec | None], first: bool
                 ) -> Callable[..., tuple[jax.Array, list[jax.Array]]]:
    """fn(weights, latents (B, z, 1, h, w) float32[, caches]) -> (frames (B, F, H, W, 3) in [0, 1], caches)."""
    mean, inv_std = _latent_stats(vae)

    def decode(weights: dict[str, Any], latents: jax.Array, *caches: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        z = latents / inv_std + mean  # diffusers: latents / (1 / std) + mean
        out, feat = extracted_fn(weights, (z, None if first else _slots(caches, specs)), {})
        frames = jnp.clip(out * 0.5 + 0.5, 0.0, 1.0)
        return jnp.transpose(frames, (0, 2, 3, 4, 1)), _normalise(feat, specs)

    return decode


def build_encode(vae: Any, extracted_fn: Callable[..., Any], specs: list[TensorSpec | None], first: bool
                 ) -> Callable[..., tuple[jax.Array, list[jax.Array]]]:
    """fn(weights, pixels (B, 3, f, H, W) float32 in [-1, 1][, caches]) -> (latents (B, z, 1, h, w), caches),
    latents normalised as the I2V pipelines do: (mean - latents_mean) * (1 / latents_std)."""
    mean, inv_std = _latent_stats(vae)

    def encode(weights: dict[str, Any], pixels: jax.Array, *caches: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        mu, feat = extracted_fn(weights, (pixels, None if first else _slots(caches, specs)), {}, method="encode")
        return (mu.astype(jnp.float32) - mean) * inv_std, _normalise(feat, specs)

    return encode
