"""The Wan VAE decoder written channels-last in JAX, for CPU targets.

Traced from diffusers through torchax, the decoder keeps its activations in (N, C, T, H, W), while
XLA's CPU convolutions run channels-last: every 3D convolution then pays a transposed copy of its
input per temporal tap and one of its output. On the 1.3B VAE that was about half of a decode
chunk's time (6.8 s, of which ~3.3 s was not convolution). Written here with channels last from
end to end, only the cache slots (two frames per causal convolution) are transposed, at the
program's edges.

It is the same computation as diffusers' `AutoencoderKLWan` decoder (Wan 2.1 and the residual
Wan 2.2 variant): the structure is read from the torch module tree, the weights by the checkpoint's
names, and the cache slots are filled in diffusers' `feat_cache` order with the same contents, so the
programs' inputs, outputs and manifest entries do not change. TPU and GPU targets keep the torchax
trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .attention import AttentionConfig, attention
from .vae import n_caches

CACHE_T = 2  # frames each causal convolution keeps (diffusers' CACHE_T)


class _Slots:
    """diffusers' feat_cache for one chunk: slot i is the input of the i-th cached call, its last CACHE_T
    frames channels-last. `old` is None in the first chunk (every slot starts as zeros, which is what
    the causal zero padding, or an unprimed upsampler's "Rep", gives)."""

    def __init__(self, old: list[jax.Array | None] | None) -> None:
        self.old = old
        self.new: list[jax.Array] = []

    @property
    def first(self) -> bool:
        return self.old is None

    def take(self, x: jax.Array) -> jax.Array | None:
        """The cache for a call on `x` (the previous chunk's frames; None in the first chunk, where it is
        zeros), recording x's as the next."""
        i = len(self.new)
        prev = jnp.zeros((x.shape[0], CACHE_T, *x.shape[2:]), x.dtype) if self.old is None else self.old[i]
        self.new.append(jnp.concatenate([prev, x], axis=1)[:, -CACHE_T:])
        return None if self.old is None else prev

    def skip(self, x: jax.Array) -> None:
        """An upsampler's first chunk: its slot is zeros ("Rep") and its time convolution does not run."""
        self.new.append(jnp.zeros((x.shape[0], CACHE_T, *x.shape[2:]), x.dtype))


def build(vae: Any, config: AttentionConfig) -> Callable[..., tuple[jax.Array, list[Any]]]:
    """fn(weights, (z, caches), kwargs) -> (pixels (B, C, F, H, W) in [-1, 1], caches): the contract of
    export/vae.py's `Parts.forward` as export/trace.py extracts it, caches as diffusers' list (NCTHW,
    None for slots never filled; `caches` None for the first chunk)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        DupUp3D,
        WanAttentionBlock,
        WanCausalConv3d,
        WanResample,
        WanResidualBlock,
        WanResidualUpBlock,
        WanRMS_norm,
        WanUpBlock,
    )

    dec = vae.decoder
    patch = vae.config.patch_size
    n_slots = n_caches(dec)
    if type(dec.nonlinearity).__name__ != "SiLU":
        raise NotImplementedError(f"VAE decoder non-linearity {dec.nonlinearity!r}: only SiLU is written here")

    def fn(weights: dict[str, Any], args: tuple, kwargs: dict[str, Any] | None = None) -> tuple[jax.Array, list]:
        z, caches = args
        w = {k[len("decoder."):]: v for k, v in weights.items() if k.startswith("decoder.")}
        old = None if caches is None else [None if c is None else jnp.transpose(c, (0, 2, 3, 4, 1)) for c in caches]
        slots = _Slots(old)
        x = _pointwise(jnp.transpose(z, (0, 2, 3, 4, 1)), weights["post_quant_conv.weight"],
                       weights["post_quant_conv.bias"])
        x = causal_conv(x, w, "conv_in", dec.conv_in, slots.take(x))
        x = resblock(x, w, "mid_block.resnets.0", dec.mid_block.resnets[0], slots)
        for i, (attn, res) in enumerate(zip(dec.mid_block.attentions, dec.mid_block.resnets[1:])):
            x = attention_block(x, w, f"mid_block.attentions.{i}", attn)
            x = resblock(x, w, f"mid_block.resnets.{i + 1}", res, slots)
        for i, up in enumerate(dec.up_blocks):
            x = up_block(x, w, f"up_blocks.{i}", up, slots)
        x = jax.nn.silu(rms_norm(x, w, "norm_out", dec.norm_out))
        x = causal_conv(x, w, "conv_out", dec.conv_out, slots.take(x))
        x = jnp.transpose(x, (0, 4, 1, 2, 3))
        if patch is not None and patch > 1:
            x = unpatchify(x, patch)
        if len(slots.new) > n_slots:
            raise AssertionError(f"decoder filled {len(slots.new)} cache slots, it has {n_slots}")
        feat = [jnp.transpose(c, (0, 4, 1, 2, 3)) for c in slots.new] + [None] * (n_slots - len(slots.new))
        return jnp.clip(x, -1.0, 1.0), feat

    def resblock(x: jax.Array, w: dict, p: str, m: Any, slots: _Slots) -> jax.Array:
        if not isinstance(m, WanResidualBlock):
            raise NotImplementedError(f"VAE decoder block {p} is a {type(m).__name__}")
        h = x if p + ".conv_shortcut.weight" not in w else _pointwise(x, w[p + ".conv_shortcut.weight"],
                                                                        w[p + ".conv_shortcut.bias"])
        x = jax.nn.silu(rms_norm(x, w, p + ".norm1", m.norm1))
        x = causal_conv(x, w, p + ".conv1", m.conv1, slots.take(x))
        x = jax.nn.silu(rms_norm(x, w, p + ".norm2", m.norm2))
        x = causal_conv(x, w, p + ".conv2", m.conv2, slots.take(x))
        return x + h

    def up_block(x: jax.Array, w: dict, p: str, m: Any, slots: _Slots) -> jax.Array:
        shortcut = x
        for j, res in enumerate(m.resnets):
            x = resblock(x, w, f"{p}.resnets.{j}", res, slots)
        if isinstance(m, WanUpBlock):
            if m.upsamplers is not None:
                x = resample(x, w, f"{p}.upsamplers.0", m.upsamplers[0], slots)
            return x
        if not isinstance(m, WanResidualUpBlock):
            raise NotImplementedError(f"VAE decoder block {p} is a {type(m).__name__}")
        if m.upsampler is not None:
            x = resample(x, w, f"{p}.upsampler", m.upsampler, slots)
        if m.avg_shortcut is not None:
            x = x + dup_up(shortcut, m.avg_shortcut, first=slots.first)
        return x

    def resample(x: jax.Array, w: dict, p: str, m: Any, slots: _Slots) -> jax.Array:
        if not isinstance(m, WanResample) or m.mode not in ("upsample2d", "upsample3d"):
            raise NotImplementedError(f"VAE decoder resampler {p}: {getattr(m, 'mode', type(m).__name__)}")
        if m.mode == "upsample3d":
            if slots.first:
                slots.skip(x)
            else:
                b, t, h, wd, c = x.shape
                x = causal_conv(x, w, p + ".time_conv", m.time_conv, slots.take(x))  # (b, t, h, w, 2c)
                # diffusers splits the channels into two frames per input frame: (b, 2, c, t) -> (b, t, 2, c)
                x = x.reshape(b, t, h, wd, 2, c).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, wd, c)
        b, t, h, wd, c = x.shape
        x = jnp.broadcast_to(x[:, :, :, None, :, None, :], (b, t, h, 2, wd, 2, c)).reshape(b, t, 2 * h, 2 * wd, c)
        conv = m.resample[1]
        y = _conv2d(x.reshape(b * t, 2 * h, 2 * wd, c), w[p + ".resample.1.weight"], conv.padding)
        return (y + w[p + ".resample.1.bias"]).reshape(b, t, *y.shape[1:])

    def dup_up(x: jax.Array, m: Any, first: bool) -> jax.Array:
        if not isinstance(m, DupUp3D):
            raise NotImplementedError(f"VAE decoder shortcut {type(m).__name__}")
        b, t, h, wd, _ = x.shape
        ft, fs, o = m.factor_t, m.factor_s, m.out_channels
        # torch: repeat_interleave over channels, then channel j = ((o * ft + a) * fs + p) * fs + q lands at
        # frame t * ft + a, row h * fs + p, column w * fs + q.
        x = jnp.repeat(x, m.repeats, axis=-1).reshape(b, t, h, wd, o, ft, fs, fs)
        x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, t * ft, h * fs, wd * fs, o)
        return x[:, ft - 1:] if first else x

    def attention_block(x: jax.Array, w: dict, p: str, m: Any) -> jax.Array:
        if not isinstance(m, WanAttentionBlock):
            raise NotImplementedError(f"VAE decoder attention {p} is a {type(m).__name__}")
        b, t, h, wd, c = x.shape
        y = rms_norm(x, w, p + ".norm", m.norm).reshape(b * t, 1, h * wd, c)
        qkv = _pointwise(y, w[p + ".to_qkv.weight"], w[p + ".to_qkv.bias"])
        q, k, v = jnp.split(qkv, 3, axis=-1)
        y = attention(q, k, v, config=config)
        y = _pointwise(y, w[p + ".proj.weight"], w[p + ".proj.bias"])
        return x + y.reshape(b, t, h, wd, c)

    def rms_norm(x: jax.Array, w: dict, p: str, m: Any) -> jax.Array:
        if not isinstance(m, WanRMS_norm) or not m.channel_first:
            raise NotImplementedError(f"VAE decoder norm {p} is a {type(m).__name__}")
        # F.normalize: x / max(||x||, 1e-12) over channels, then * sqrt(dim) * gamma (+ bias)
        norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))
        out = x / jnp.maximum(norm, 1e-12) * (m.scale * w[p + ".gamma"].reshape(-1))
        return out + w[p + ".bias"].reshape(-1) if p + ".bias" in w else out

    def causal_conv(x: jax.Array, w: dict, p: str, m: Any, cache: jax.Array | None) -> jax.Array:
        if not isinstance(m, WanCausalConv3d) or m.stride != (1, 1, 1) or m.dilation != (1, 1, 1) or m.groups != 1:
            raise NotImplementedError(f"VAE decoder convolution {p}: {m!r}")
        pw, _, ph, _, front, _ = m._padding
        if front not in (0, CACHE_T):
            raise NotImplementedError(f"VAE decoder convolution {p}: causal padding {front}")
        if front and cache is None:  # first chunk: zero frames in front, whose taps are skipped
            return conv3d(x, w[p + ".weight"], w[p + ".bias"], (ph, pw), zeros_in_front=front)
        if front:  # the cache stands in for the causal zero frames (diffusers: padding[4] -= cache frames)
            x = jnp.concatenate([cache, x], axis=1)
        return conv3d(x, w[p + ".weight"], w[p + ".bias"], (ph, pw))

    return fn


def conv3d(x: jax.Array, w: jax.Array, b: jax.Array, pad_hw: tuple[int, int], zeros_in_front: int = 0
           ) -> jax.Array:
    """A 3D convolution, valid in time and zero-padded by `pad_hw` in space, on (B, T, H, W, C) with a torch
    (O, C, kt, kh, kw) kernel: kt channels-last 2D convolutions over frames folded into the batch, summed
    (XLA's CPU backend runs 3D convolutions several times slower than the same 2D work).

    `zeros_in_front`: x is preceded by that many zero frames (a first chunk's causal padding). They are not
    materialised: a tap's 2D convolution runs only on the frames it sees that are not zeros (exact: a zero
    frame adds nothing), so a one-frame first chunk costs one tap instead of kt.
    """
    kt, kh, kw = w.shape[2:]
    if kt == kh == kw == 1:
        return _pointwise(x, w, b)
    n, t = x.shape[:2]
    t_out = t + zeros_in_front - kt + 1
    out = None
    for k in range(kt):
        skip = max(zeros_in_front - k, 0)  # leading outputs for which this tap sees only zero frames
        if skip >= t_out:
            continue
        start = k - zeros_in_front + skip  # first real frame this tap reads
        frames = x[:, start:start + t_out - skip].reshape(n * (t_out - skip), *x.shape[2:])
        y = _conv2d(frames, w[:, :, k], pad_hw)
        y = y.reshape(n, t_out - skip, *y.shape[1:])
        if skip:
            y = jnp.pad(y, ((0, 0), (skip, 0), (0, 0), (0, 0), (0, 0)))
        out = y if out is None else out + y
    return out + b


def _conv2d(x: jax.Array, w: jax.Array, pad_hw: tuple[int, int]) -> jax.Array:
    """NHWC 2D convolution with a torch (O, C, kh, kw) kernel, stride 1, zero padding `pad_hw`."""
    return jax.lax.conv_general_dilated(x, jnp.transpose(w, (2, 3, 1, 0)), (1, 1),
                                        [(pad_hw[0], pad_hw[0]), (pad_hw[1], pad_hw[1])],
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _pointwise(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """A 1x1(x1) convolution on channels-last x: a matmul over the last axis."""
    return jnp.einsum("...c,oc->...o", x, w.reshape(w.shape[0], -1)) + b


def unpatchify(x: jax.Array, p: int) -> jax.Array:
    """diffusers' unpatchify: (B, C*p*p, F, H, W) -> (B, C, F, H*p, W*p), channel index c*p*p + q*p + r
    going to row h*p + r and column w*p + q."""
    b, cpp, f, h, wd = x.shape
    x = x.reshape(b, cpp // (p * p), p, p, f, h, wd).transpose(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cpp // (p * p), f, h * p, wd * p)

