"""The exported attention against a plain softmax reference (fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from export.attention import AttentionConfig, attention


def reference(q, k, v, bias=None, scale=None):
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) * scale
    if bias is not None:
        s = s + bias
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, v.astype(np.float64))


@pytest.mark.parametrize("sq,sk,bq,bk", [(37, 37, 16, 8), (50, 13, 7, 5), (64, 64, 64, 64), (9, 100, 4, 33)])
def test_blocked_matches_reference(sq: int, sk: int, bq: int, bk: int) -> None:
    rng = np.random.default_rng(sq * 1000 + sk)
    q, k, v = (rng.standard_normal((2, 3, n, 8)).astype(np.float32) for n in (sq, sk, sk))
    cfg = AttentionConfig(block_q=bq, block_kv=bk, direct_limit=0)
    out = jax.jit(lambda a, b, c: attention(a, b, c, config=cfg))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v), atol=2e-6)


def test_mask_and_scale_like_umt5() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(3))
    bias = np.where(np.arange(6) < 4, 0.0, -1e9).astype(np.float32)[None, None, None, :]
    out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), attn_mask=jnp.asarray(bias), scale=1.0)
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v, bias, 1.0), atol=2e-6)
    bool_mask = jnp.asarray(bias == 0)
    out_b = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), attn_mask=bool_mask, scale=1.0)
    np.testing.assert_allclose(np.asarray(out_b), np.asarray(out), atol=1e-7)


def test_bf16_inputs_accumulate_in_fp32() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 40, 16)).astype(np.float32) for _ in range(3))
    cfg = AttentionConfig(block_q=16, block_kv=16, direct_limit=0)
    out = attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), config=cfg)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), reference(q, k, v), atol=3e-2)


def test_480p_sequence_never_materialises_the_score_matrix() -> None:
    """1.3B at 480p is 32,760 tokens: XLA's own buffer plan for our attention stays a small fraction
    of one head's S x S score matrix (4 GiB in fp32), so it runs on a CPU or GPU."""
    s = 32760
    x = jax.ShapeDtypeStruct((1, 2, s, 128), jnp.bfloat16)
    compiled = jax.jit(lambda q, k, v: attention(q, k, v)).lower(x, x, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 0.05 * s * s * 4, f"{temp / 2**20:.0f} MiB of temporaries"


@pytest.mark.parametrize("direct_limit", [0, 1 << 30])  # blocked online softmax, direct
def test_a_bias_per_key_is_the_softmax_of_repeated_keys(direct_limit: int) -> None:
    """A (1, 1, 1, S) float mask is one bias per key, added block by block (never broadcast to the scores'
    shape); log(m) on a key is the same softmax as m copies of it (export/cross_kv.py's short prompts)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 3, 11, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 3, 7, 8)).astype(np.float32) for _ in range(2))
    m = 40
    bias = np.zeros((1, 1, 1, 7), np.float32)
    bias[..., -1] = np.log(m)
    cfg = AttentionConfig(block_q=4, block_kv=3, direct_limit=direct_limit)
    out = jax.jit(lambda a, b, c, d: attention(a, b, c, attn_mask=d, config=cfg))(q, k, v, bias)
    repeated = [np.concatenate([x[:, :, :-1], np.repeat(x[:, :, -1:], m, axis=2)], axis=2) for x in (k, v)]
    np.testing.assert_allclose(np.asarray(out), reference(q, *repeated), atol=2e-6)
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v, bias), atol=2e-6)


@pytest.mark.parametrize("direct_limit", [0, 4096 * 4096])
def test_block_causal_self_attention_matches_a_dense_mask(direct_limit: int) -> None:
    """Diffusion forcing's asynchronous mode on XLA (CPU, GPU): inside `block_causal`, the hooked attention modules'
    self-attention masks the keys of later causal blocks (blocked online softmax or direct); the block size is traced
    (<= 1: full attention, as diffusers)."""
    import torch

    from export.attention import _CAUSAL, BlockCausal, block_causal

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 60, 8)).astype(np.float32) for _ in range(3))
    cfg = AttentionConfig(block_q=16, block_kv=8, direct_limit=direct_limit)
    frame_tokens = 6
    fn = jax.jit(lambda a, b, c, n: _causal_call(a, b, c, n, frame_tokens, cfg))
    for n in (1, 2, 3):
        blocks = np.arange(60) // frame_tokens // n
        bias = np.where(blocks[None, :] <= blocks[:, None], 0.0, -np.inf) if n > 1 else None
        np.testing.assert_allclose(np.asarray(fn(q, k, v, jnp.int32(n))), reference(q, k, v, bias), atol=2e-6)
    module = torch.nn.Linear(1, 1)  # the hooks set the mask around this module's calls only
    with block_causal([module], BlockCausal(frame_tokens, jnp.int32(2))):
        assert _CAUSAL.get() is None
        module.register_forward_pre_hook(lambda *a: seen.append(_CAUSAL.get()))
        seen: list = []
        module(torch.zeros(1))
    assert seen and seen[0] is not None and _CAUSAL.get() is None


def _causal_call(q, k, v, n, frame_tokens: int, cfg: AttentionConfig):
    from export.attention import _CAUSAL, BlockCausal

    token = _CAUSAL.set(BlockCausal(frame_tokens, n))
    try:
        return attention(q, k, v, config=cfg)
    finally:
        _CAUSAL.reset(token)
