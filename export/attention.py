"""The one attention implementation baked into every exported program.

Every Wan module (DiT self/cross attention, VAE mid-block attention, UMT5) calls
``torch.nn.functional.scaled_dot_product_attention``. torchax's own lowering
materialises the full S x S score matrix, which cannot run at real sizes (32,760
tokens at 480p, 75,600 at 720p), so the export replaces it with
:func:`attention`: exact softmax attention for short sequences and a blocked
online-softmax (flash-style) loop over key/value blocks for long ones, so the
score matrix never exists whole. Ragged lengths are padded and the padding masked.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_MASKED = -1e30


@dataclass(frozen=True)
class AttentionConfig:
    """Block sizes of the blocked path; sequences with q_len * kv_len <= direct_limit go direct."""

    block_q: int = 1024
    block_kv: int = 1024
    direct_limit: int = 4096 * 4096

    def to_json(self) -> dict[str, Any]:
        return {"impl": "xla-blocked", "block_q": self.block_q, "block_kv": self.block_kv,
                "direct_limit": self.direct_limit}


def _direct(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, scale: float) -> jax.Array:
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if bias is not None:
        s = s + bias
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32))


def _blocked(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, block_q: int, block_kv: int) -> jax.Array:
    """Online-softmax attention over kv blocks, one q block at a time (no mask)."""
    b, h, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    bq, bk = min(block_q, sq), min(block_kv, sk)
    nq, nk = -(-sq // bq), -(-sk // bk)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, nq * bq - sq), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, 0), (0, nk * bk - sk), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, nk * bk - sk), (0, 0)))
    kb = k.reshape(b, h, nk, bk, d).transpose(2, 0, 1, 3, 4)
    vb = v.reshape(b, h, nk, bk, dv).transpose(2, 0, 1, 3, 4)
    valid = (jnp.arange(nk * bk) < sk).reshape(nk, bk)

    def one_q_block(qi: jax.Array) -> jax.Array:
        qi = qi.astype(jnp.float32) * scale

        def step(carry: tuple, blk: tuple) -> tuple:
            m, l, acc = carry
            kj, vj, ok = blk
            s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj.astype(jnp.float32))
            s = jnp.where(ok[None, None, None, :], s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            l_new = alpha * l + p.sum(axis=-1)
            acc_new = alpha[..., None] * acc + jnp.einsum("bhqk,bhkd->bhqd", p, vj.astype(jnp.float32))
            return (m_new, l_new, acc_new), None

        init = (jnp.full((b, h, bq), _MASKED, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
                jnp.zeros((b, h, bq, dv), jnp.float32))
        (m, l, acc), _ = lax.scan(step, init, (kb, vb, valid))
        return acc / l[..., None]

    qb = q.reshape(b, h, nq, bq, d).transpose(2, 0, 1, 3, 4)
    out = lax.map(one_q_block, qb)  # (nq, b, h, bq, dv)
    return out.transpose(1, 2, 0, 3, 4).reshape(b, h, nq * bq, dv)[:, :, :sq]


def attention(query: jax.Array, key: jax.Array, value: jax.Array, attn_mask: jax.Array | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, config: AttentionConfig = AttentionConfig()) -> jax.Array:
    """`F.scaled_dot_product_attention` semantics on (B, H, S, D) arrays, fp32 accumulation."""
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
    if bias is not None or sq * sk <= config.direct_limit:
        out = _direct(q, k, v, bias, scale)
    else:
        out = _blocked(q, k, v, scale, config.block_q, config.block_kv)
    return out.astype(q.dtype)


def install(env: Any, config: AttentionConfig) -> None:
    """Route torch SDPA (functional and aten) inside torchax `env` to :func:`attention`."""
    import torch
    from torchax.ops import ops_registry

    impl = functools.partial(attention, config=config)
    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        env._ops[op] = ops_registry.Operator(op, impl, is_jax_function=True, is_user_defined=True,
                                             needs_env=False, is_view_op=False)
