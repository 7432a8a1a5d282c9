"""The one attention implementation baked into every exported program.

Every Wan module (DiT self/cross attention, VAE mid-block attention, UMT5) calls
``torch.nn.functional.scaled_dot_product_attention``. torchax's own lowering
materialises the full S x S score matrix, which cannot run at real sizes (32,760
tokens at 480p, 75,600 at 720p), so the export replaces it with
:func:`attention`: exact softmax attention for short sequences and a blocked
online-softmax (flash-style) loop over key/value blocks for long ones, so the
score matrix never exists whole. Ragged lengths are padded and the padding masked.

In the DiT (``install(..., mesh=...)``) attention is also where the layout is
pinned: it runs inside ``shard_map`` with heads over tp and the query sequence over
sp for self-attention, or the query sequence over (tp, sp) with K/V replicated for
cross-attention (export/sharding.py). On TPU targets the per-device computation is
the Pallas flash kernel (export/flash_tpu.py), which can only run inside shard_map.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, PartitionSpec

from . import sharding
from .flash_tpu import FlashBlocks, flash_attention

_MASKED = -1e30


@dataclass(frozen=True)
class BlockCausal:
    """Block-causal self-attention over latent frames (SkyReels-V2 diffusion forcing's asynchronous mode, diffusers'
    `_set_ar_attention`): token i, of frame i // frame_tokens, sees token j when j's block of `block_frames` frames is
    not after i's. `block_frames` is a traced int32 scalar (a program input, so one program serves every causal
    block size); <= 1 means full attention, as diffusers masks only when num_frame_per_block > 1. Tokens are
    frame-major (diffusers' patch embedding flattens (frames, height, width))."""

    frame_tokens: int
    block_frames: jax.Array

    def visible(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        """Whether queries at global positions `q_pos` see keys at `k_pos` (broadcast against each other)."""
        n = jnp.maximum(self.block_frames, 1)
        return (self.block_frames <= 1) | (k_pos // self.frame_tokens // n <= q_pos // self.frame_tokens // n)


_CAUSAL: contextvars.ContextVar[BlockCausal | None] = contextvars.ContextVar("block_causal", default=None)


@contextlib.contextmanager
def block_causal(attentions: list[Any], causal: BlockCausal) -> Iterator[None]:
    """While active, the self-attention of these (torch) attention modules is block-causal (`causal`): forward hooks
    set it around their calls only, so cross-attention in the same blocks stays unmasked."""
    tokens: list[Any] = []

    def enter(module: Any, args: Any) -> None:
        tokens.append(_CAUSAL.set(causal))

    def leave(module: Any, args: Any, out: Any) -> None:
        _CAUSAL.reset(tokens.pop())

    handles = [h for a in attentions for h in (a.register_forward_pre_hook(enter), a.register_forward_hook(leave))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class AttentionConfig:
    """How attention is computed.

    kernel "xla": plain JAX, direct when q_len * kv_len <= direct_limit, else blocked
    online softmax with (block_q, block_kv). kernel "pallas": the TPU flash kernel with
    `flash` blocks (the seeds' 720p defaults) and optional K smoothing, DiT only.
    """

    block_q: int = 1024
    block_kv: int = 1024
    direct_limit: int = 4096 * 4096
    kernel: str = "xla"
    flash: FlashBlocks = FlashBlocks()
    k_smoothing: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"impl": "xla-blocked", "block_q": self.block_q, "block_kv": self.block_kv,
                               "direct_limit": self.direct_limit}
        if self.kernel == "pallas":
            out["dit"] = {"impl": "pallas-tpu-flash", "block_q": self.flash.block_q, "block_kv": self.flash.block_kv,
                          "block_kv_compute": self.flash.block_kv_compute, "k_smoothing": self.k_smoothing}
        return out


def _direct(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, scale: float,
            causal: BlockCausal | None = None, q_offset: Any = 0) -> jax.Array:
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if bias is not None:
        s = s + bias
    if causal is not None:
        q_pos = q_offset + jnp.arange(q.shape[2])[:, None]
        s = jnp.where(causal.visible(q_pos, jnp.arange(k.shape[2])[None, :]), s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32))


def _blocked(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, block_q: int, block_kv: int,
             key_bias: jax.Array | None = None, causal: BlockCausal | None = None, q_offset: Any = 0) -> jax.Array:
    """Online-softmax attention over kv blocks, one q block at a time (`key_bias`: added to every query's
    score of each key, see `attention`; `causal`: block-causal, the queries at `q_offset` + their index)."""
    b, h, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    bq, bk = min(block_q, sq), min(block_kv, sk)
    nq, nk = -(-sq // bq), -(-sk // bk)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, nq * bq - sq), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, 0), (0, nk * bk - sk), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, nk * bk - sk), (0, 0)))
    kb = k.reshape(b, h, nk, bk, d).transpose(2, 0, 1, 3, 4)
    vb = v.reshape(b, h, nk, bk, dv).transpose(2, 0, 1, 3, 4)
    bias = jnp.zeros((sk,), jnp.float32) if key_bias is None else key_bias.astype(jnp.float32)
    bias = jnp.pad(bias, (0, nk * bk - sk), constant_values=_MASKED).reshape(nk, bk)  # padded keys masked

    def one_q_block(args: tuple) -> jax.Array:
        qi, iq = args
        qi = qi.astype(jnp.float32) * scale

        def step(carry: tuple, blk: tuple) -> tuple:
            m, l, acc = carry
            kj, vj, bj, jk = blk
            s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj.astype(jnp.float32)) + bj
            if causal is not None:
                q_pos = q_offset + iq * bq + jnp.arange(bq)[:, None]
                s = jnp.where(causal.visible(q_pos, jk * bk + jnp.arange(bk)[None, :]), s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            l_new = alpha * l + p.sum(axis=-1)
            acc_new = alpha[..., None] * acc + jnp.einsum("bhqk,bhkd->bhqd", p, vj.astype(jnp.float32))
            return (m_new, l_new, acc_new), None

        init = (jnp.full((b, h, bq), _MASKED, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
                jnp.zeros((b, h, bq, dv), jnp.float32))
        (m, l, acc), _ = lax.scan(step, init, (kb, vb, bias, jnp.arange(nk)))
        return acc / l[..., None]

    qb = q.reshape(b, h, nq, bq, d).transpose(2, 0, 1, 3, 4)
    out = lax.map(one_q_block, (qb, jnp.arange(nq)))  # (nq, b, h, bq, dv)
    return out.transpose(1, 2, 0, 3, 4).reshape(b, h, nq * bq, dv)[:, :, :sq]


def attention(query: jax.Array, key: jax.Array, value: jax.Array, attn_mask: jax.Array | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, config: AttentionConfig = AttentionConfig(),
              mesh: AbstractMesh | None = None) -> jax.Array:
    """`F.scaled_dot_product_attention` semantics on (B, H, S, D) arrays, fp32 accumulation.

    With `mesh` (the DiT), unmasked attention runs sharded over the mesh (see module doc), and so does attention
    whose float mask is one bias per key, (1, 1, 1, S_kv) (the cross-attention of export/cross_kv.py's keys and
    values over a short prompt): that bias is added to the scores block by block, never broadcast to their shape.
    """
    q, k, v = query, key, value
    if dropout_p:
        raise NotImplementedError("attention dropout is not supported in exported inference programs")
    if enable_gqa and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    sq, sk = q.shape[-2], k.shape[-2]
    bias = None
    if attn_mask is not None:
        bias = jnp.where(attn_mask, 0.0, _MASKED) if attn_mask.dtype == jnp.bool_ else attn_mask.astype(jnp.float32)
    if is_causal:
        causal = jnp.where(jnp.tril(jnp.ones((sq, sk), jnp.bool_)), 0.0, _MASKED)
        bias = causal if bias is None else bias + causal
    key_bias = None
    if bias is not None and bias.ndim == 4 and bias.shape[:3] == (1, 1, 1):
        key_bias, bias = bias.reshape(-1), None  # the same for every query: no score matrix-sized mask
    causal = _CAUSAL.get()
    if causal is not None and (bias is not None or key_bias is not None or sq != sk):
        raise NotImplementedError("block-causal attention is for unmasked self-attention")
    if bias is not None:
        return _direct(q, k, v, bias, scale).astype(q.dtype)
    if mesh is not None:
        return _sharded(q, k, v, scale, config, mesh, key_bias, causal)
    return _local(q, k, v, key_bias, scale, config, causal)


def _local(q: jax.Array, k: jax.Array, v: jax.Array, key_bias: jax.Array | None, scale: float,
           config: AttentionConfig, causal: BlockCausal | None = None, q_offset: Any = 0) -> jax.Array:
    """Attention on one device's arrays, unmasked but for an optional bias per key, or block-causal (`causal`, the
    queries at global positions `q_offset` + their index: a shard of the sequence)."""
    if config.kernel == "pallas":
        if key_bias is not None:
            raise NotImplementedError("the TPU flash kernel takes no attention bias")
        return flash_attention(q, k, v, scale=scale, blocks=config.flash, k_smoothing=config.k_smoothing,
                               causal=None if causal is None else (causal.frame_tokens, causal.block_frames, q_offset))
    if q.shape[-2] * k.shape[-2] <= config.direct_limit:
        out = _direct(q, k, v, key_bias, scale, causal, q_offset)
    else:
        out = _blocked(q, k, v, scale, config.block_q, config.block_kv, key_bias, causal, q_offset)
    return out.astype(q.dtype)


def _sharded(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, config: AttentionConfig,
             mesh: AbstractMesh, key_bias: jax.Array | None = None, causal: BlockCausal | None = None) -> jax.Array:
    """DiT attention inside shard_map: self-attention split on heads (tp) and queries (the layout's sequence
    axes, sp); cross-attention (kv length != q length) on queries over (tp, sequence axes) with K/V whole,
    queries padded to divide. The layout is the traced program's (export/sharding.py `current_layout`).
    A `key_bias` goes whole to every device, as K/V do."""
    sq = q.shape[2]
    layout = sharding.current_layout()
    if k.shape[2] == sq:
        q_spec, kv_spec = layout.self_q, layout.self_kv
    else:
        q_spec, kv_spec = layout.cross_q, layout.cross_kv
        split = layout.query_split(mesh)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, -sq % split), (0, 0)))
    if causal is not None:  # self-attention: each device's queries are the shard at its index over the sequence axes
        seq = layout.seq

        def local_causal(q: jax.Array, k: jax.Array, v: jax.Array, block_frames: jax.Array) -> jax.Array:
            index = 0
            for a in seq:
                index = index * mesh.shape[a] + lax.axis_index(a)
            return _local(q, k, v, None, scale, config, BlockCausal(causal.frame_tokens, block_frames),
                          index * q.shape[2])

        out = jax.shard_map(local_causal, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec()),
                            out_specs=q_spec, check_vma=False)(q, k, v, causal.block_frames)
    elif key_bias is None:
        local = functools.partial(_local, key_bias=None, scale=scale, config=config)
        out = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                            check_vma=False)(q, k, v)
    else:
        local = functools.partial(_local, scale=scale, config=config)
        out = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec()),
                            out_specs=q_spec, check_vma=False)(q, k, v, key_bias)
    return out[:, :, :sq]


def install(env: Any, config: AttentionConfig, mesh: AbstractMesh | None = None) -> None:
    """Route torch SDPA (functional and aten) inside torchax `env` to :func:`attention`.

    `mesh` is given for the DiT only: its attention is pinned to the mesh layout.
    """
    import torch
    from torchax.ops import ops_registry

    impl = functools.partial(attention, config=config, mesh=mesh)
    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        env._ops[op] = ops_registry.Operator(op, impl, is_jax_function=True, is_user_defined=True,
                                             needs_env=False, is_view_op=False)
