"""Convolutions XLA's CPU backend runs slowly, as the same arithmetic in forms it runs fast (CPU targets only).

- 3D convolutions as sums of 2D ones, for the traced VAE encoder: a 3D convolution runs several times slower than
  the same work as 2D convolutions (measured on the Wan VAE's 3x3x3 layers: 0.38 s vs 0.12 s; torch 0.05 s), so
  each (kt, kh, kw) kernel becomes kt 2D convolutions over frames folded into the batch, summed.
- Depthwise 2D convolutions (groups = channels, one filter each: Wan-Animate's motion encoder blurs with them) as
  a sum of kh x kw shifted, scaled copies of the input, which XLA fuses into one elementwise loop (a 4x4 blur of
  9 x 32 x 258 x 258: 0.56 s as a grouped convolution, 0.06 s shifted).

Same arithmetic, different order of the sums. TPU and GPU keep the convolutions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def conv3d_as_2d(x: jax.Array, w: jax.Array, bias: jax.Array | None, stride: tuple[int, ...],
                 padding: tuple[int, ...], dilation: tuple[int, ...]) -> jax.Array:
    """torch's conv3d (N, C, T, H, W) x (O, C, kt, kh, kw), groups=1, as kt 2D convolutions."""
    if padding[0]:
        x = jnp.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (0, 0), (0, 0)))
    n, c, t, h, wd = x.shape
    kt, st, dt = w.shape[2], stride[0], dilation[0]
    t_out = (t - dt * (kt - 1) - 1) // st + 1
    out = None
    for k in range(kt):
        frames = x[:, :, k * dt: k * dt + st * (t_out - 1) + 1: st]
        frames = frames.transpose(0, 2, 1, 3, 4).reshape(n * t_out, c, h, wd)
        y = jax.lax.conv_general_dilated(frames, w[:, :, k], window_strides=tuple(stride[1:]),
                                         padding=[(p, p) for p in padding[1:]], rhs_dilation=tuple(dilation[1:]),
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        out = y if out is None else out + y
    out = out.reshape(n, t_out, *out.shape[1:]).transpose(0, 2, 1, 3, 4)
    if bias is not None:
        out = out + bias.reshape(1, -1, 1, 1, 1).astype(out.dtype)
    return out


def depthwise_as_shifts(x: jax.Array, w: jax.Array, bias: jax.Array | None, stride: tuple[int, ...],
                        padding: tuple[int, ...], dilation: tuple[int, ...]) -> jax.Array:
    """torch's conv2d (N, C, H, W) x (C, 1, kh, kw) with groups=C, as kh x kw shifted multiply-adds."""
    x = jnp.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])))
    (kh, kw), (sh, sw), (dh, dw) = w.shape[2:], stride, dilation
    h_out = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    w_out = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    out = None
    for i in range(kh):
        for j in range(kw):
            term = x[:, :, i * dh: i * dh + sh * (h_out - 1) + 1: sh, j * dw: j * dw + sw * (w_out - 1) + 1: sw] \
                * w[:, 0, i, j].reshape(1, -1, 1, 1).astype(x.dtype)
            out = term if out is None else out + term
    if bias is not None:
        out = out + bias.reshape(1, -1, 1, 1).astype(out.dtype)
    return out


def _depthwise(x: Any, w: Any, groups: int, transposed: bool, stride: Any, padding: Any, dilation: Any) -> bool:
    return (x.ndim == 4 and not transposed and groups > 1 and groups == x.shape[1] == w.shape[0] and w.shape[1] == 1
            and len(stride) == len(padding) == len(dilation) == 2)


def install(env: Any) -> None:
    """Route torch's 5-D, ungrouped, non-transposed convolutions in torchax `env` through conv3d_as_2d, and its 4-D
    depthwise ones through depthwise_as_shifts."""
    import torch
    from torchax.ops import ops_registry

    registered = env._ops.get(torch.ops.aten.convolution.default) or env._ops[torch.ops.aten.convolution]
    original = registered.func

    def convolution(x: Any, w: Any, bias: Any, stride: Any, padding: Any, dilation: Any, transposed: bool,
                    output_padding: Any, groups: int) -> Any:
        if _depthwise(x, w, groups, transposed, stride, padding, dilation):
            return depthwise_as_shifts(x, w, bias, tuple(stride), tuple(padding), tuple(dilation))
        if x.ndim != 5 or transposed or groups != 1 or len(stride) != 3 or len(padding) != 3 or len(dilation) != 3:
            return original(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
        return conv3d_as_2d(x, w, bias, tuple(stride), tuple(padding), tuple(dilation))

    for op in (torch.ops.aten.convolution, torch.ops.aten.convolution.default):
        env._ops[op] = ops_registry.Operator(op, convolution, is_jax_function=True, is_user_defined=True,
                                             needs_env=False, is_view_op=False)
