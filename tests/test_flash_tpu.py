"""The Pallas TPU flash-attention kernel: interpret mode on CPU against a reference, and TPU lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from export import flash_tpu
from export.flash_tpu import FlashBlocks, fit_blocks, flash_attention

# Max abs error vs the reference (computed in float64 from the same, possibly bf16-rounded, inputs).
FP32_ATOL = 2e-5
BF16_ATOL = 2e-2

SMALL = FlashBlocks(block_q=128, block_kv=256, block_kv_compute=128)
MID = FlashBlocks(block_q=256, block_kv=512, block_kv_compute=256)
DEFAULT = FlashBlocks()


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None = None) -> np.ndarray:
    """softmax(q k^T * scale) v in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


def inputs(b: int, h: int, sq: int, sk: int, d: int, dtype=jnp.float32, seed: int = 0,
           k_offset: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, sq, d))
    k = rng.standard_normal((b, h, sk, d)) + k_offset * rng.standard_normal((b, h, 1, d))
    v = rng.standard_normal((b, h, sk, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@functools.cache
def interpreted(blocks: FlashBlocks, k_smoothing: bool, scale: float | None = None):
    return jax.jit(functools.partial(flash_attention, blocks=blocks, k_smoothing=k_smoothing, scale=scale,
                                     interpret=True))


def max_err(out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, scale: float | None = None) -> float:
    as_np = [np.asarray(x.astype(jnp.float32)) for x in (q, k, v)]
    return float(np.abs(np.asarray(out.astype(jnp.float32)) - reference(*as_np, scale=scale)).max())


# (B, H, Sq, Sk, D, blocks): Sq/Sk deliberately not multiples of the blocks.
SELF = [
    (1, 2, 300, 300, 64, SMALL),
    (2, 2, 520, 520, 128, SMALL),
    (1, 3, 700, 700, 64, MID),
    (2, 1, 700, 700, 128, DEFAULT),   # default blocks clamp to one 768-row q and kv block
]
CROSS = [
    (1, 2, 650, 77, 64, DEFAULT),     # Sk < one kv compute step: a single masked sub-block
    (2, 2, 400, 512, 128, SMALL),     # Sk a block multiple: no kv masking at all
    (1, 2, 600, 500, 64, MID),
    (2, 1, 300, 77, 128, SMALL),
]


@pytest.mark.parametrize("k_smoothing", [False, True])
@pytest.mark.parametrize("b,h,sq,sk,d,blocks", SELF + CROSS)
def test_matches_reference_fp32(b, h, sq, sk, d, blocks, k_smoothing):
    q, k, v = inputs(b, h, sq, sk, d, seed=sq + sk, k_offset=3.0 if k_smoothing else 0.0)
    out = interpreted(blocks, k_smoothing)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert max_err(out, q, k, v) < FP32_ATOL


@pytest.mark.parametrize("k_smoothing", [False, True])
@pytest.mark.parametrize("b,h,sq,sk,d,blocks", [SELF[1], SELF[3], CROSS[0], CROSS[2]])
def test_matches_reference_bf16(b, h, sq, sk, d, blocks, k_smoothing):
    q, k, v = inputs(b, h, sq, sk, d, dtype=jnp.bfloat16, seed=1, k_offset=3.0 if k_smoothing else 0.0)
    out = interpreted(blocks, k_smoothing)(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    assert max_err(out, q, k, v) < BF16_ATOL


def test_explicit_scale():
    q, k, v = inputs(1, 2, 200, 300, 64, seed=3)
    out = interpreted(SMALL, False, 0.3)(q, k, v)
    assert max_err(out, q, k, v, scale=0.3) < FP32_ATOL


@pytest.mark.parametrize("sk", [257, 513])
def test_padded_kv_is_masked(sk):
    """Sk just over a kv-block multiple; every real score is far below the score 0 a zero pad key would get.

    If padded keys leaked into the softmax they would dominate it and pull the output towards 0.
    """
    rng = np.random.default_rng(sk)
    d = 64
    direction = np.ones(d) / np.sqrt(d)
    q = -4.0 * direction + 0.1 * rng.standard_normal((1, 2, 300, d))
    k = 4.0 * direction + 0.1 * rng.standard_normal((1, 2, sk, d))
    v = 1.0 + rng.standard_normal((1, 2, sk, d))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    out = interpreted(SMALL, False)(q, k, v)
    assert max_err(out, q, k, v) < FP32_ATOL


@pytest.mark.parametrize("kv_len", [256 + 1, 256 + 130, 512 - 1])
def test_padding_content_is_ignored(kv_len):
    """Call the kernel directly with large garbage in the padded kv rows: the output must not see it."""
    blocks, d, sq = SMALL, 128, 256
    q, k, v = inputs(1, 2, sq, kv_len, d, seed=kv_len)
    pad = flash_tpu._round_up(kv_len, blocks.block_kv) - kv_len
    garbage = jnp.full((1, 2, pad, d), 1e3, jnp.float32)
    k_pad, v_pad = (jnp.concatenate([x, garbage], axis=2) for x in (k, v))
    qs = q * (1.0 / np.sqrt(d) * np.log2(np.e))
    flat = [x.reshape(2, -1, d) for x in (qs, k_pad, v_pad)]
    out = flash_tpu._flash_call(*flat, blocks, kv_len, interpret=True)          # (N, D, Sq)
    out = out.transpose(0, 2, 1).reshape(1, 2, sq, d)
    assert max_err(out, q, k, v) < FP32_ATOL


def test_k_smoothing_is_softmax_invariant():
    q, k, v = inputs(1, 2, 300, 300, 64, seed=7, k_offset=5.0)
    plain = interpreted(SMALL, False)(q, k, v)
    smooth = interpreted(SMALL, True)(q, k, v)
    assert float(jnp.abs(plain - smooth).max()) < FP32_ATOL


def test_fit_blocks():
    assert fit_blocks(DEFAULT, 75_600, 75_600) == DEFAULT
    assert fit_blocks(DEFAULT, 75_600, 512) == FlashBlocks(3328, 512, 256)
    assert fit_blocks(DEFAULT, 1000, 77) == FlashBlocks(1024, 128, 128)
    assert fit_blocks(DEFAULT, 1000, 1000) == FlashBlocks(1024, 1024, 256)
    assert fit_blocks(SMALL, 300, 300) == SMALL


@pytest.mark.parametrize("kwargs", [{"block_q": 100}, {"block_kv": 300, "block_kv_compute": 256},
                                    {"block_kv_compute": 64, "block_kv": 256}])
def test_bad_blocks_rejected(kwargs):
    with pytest.raises(ValueError):
        FlashBlocks(**kwargs)


def _export_tpu(shape_q: tuple[int, ...], shape_kv: tuple[int, ...], dtype=jnp.bfloat16,
                **kwargs) -> jax.export.Exported:
    fn = jax.jit(functools.partial(flash_attention, **kwargs))
    sds = [jax.ShapeDtypeStruct(s, dtype) for s in (shape_q, shape_kv, shape_kv)]
    return jax.export.export(fn, platforms=("tpu",))(*sds)


def test_lowers_to_mosaic_for_tpu():
    exp = _export_tpu((1, 2, 1000, 128), (1, 2, 1000, 128))
    assert "tpu_custom_call" in exp.mlir_module()
    assert exp.platforms == ("tpu",)


@pytest.mark.parametrize("sq,sk,dtype", [(1000, 1000, jnp.bfloat16), (75_600, 512, jnp.bfloat16),
                                         (75_600, 75_600, jnp.float32)])
def test_exported_signature(sq, sk, dtype):
    """Real Wan 720p sizes (self and cross attention) lower with the default blocks."""
    exp = _export_tpu((1, 2, sq, 128), (1, 2, sk, 128), dtype=dtype, k_smoothing=True)
    (out,) = exp.out_avals
    assert out.shape == (1, 2, sq, 128) and out.dtype == dtype
    assert "tpu_custom_call" in exp.mlir_module()


def causal_reference(q, k, v, frame_tokens: int, block_frames: int, q_offset: int = 0) -> np.ndarray:
    """Dense block-causal attention in float64: query at global position q_offset + i sees key j when j's block of
    block_frames frames (frame_tokens tokens each) is not after its own; no mask for block_frames <= 1."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if block_frames > 1:
        qb = (q_offset + np.arange(q.shape[2])) // frame_tokens // block_frames
        kb = np.arange(k.shape[2]) // frame_tokens // block_frames
        s = np.where(kb[None, :] <= qb[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


@functools.cache
def causal_kernel(frame_tokens: int):
    """The interpreted kernel, block-causal over frames of `frame_tokens`; the block size and the queries' offset are
    traced inputs (one program serves them all, as in a bundle)."""
    return jax.jit(lambda q, k, v, n, off: flash_attention(q, k, v, blocks=SMALL, interpret=True,
                                                           causal=(frame_tokens, n, off)))


# (Sq, Sk, frame tokens, [(frames per causal block, the queries' offset: a shard of the sequence)])
CAUSAL = [
    (300, 300, 20, [(2, 0), (1, 0), (7, 0)]),  # boundaries inside kv sub-blocks; 1: full attention (as diffusers)
    (150, 600, 30, [(3, 150)]),                # the second quarter of a sequence sharded over sp
    (520, 520, 8, [(5, 0)]),                   # ragged kv: the last block masked by length and by block
]


@pytest.mark.parametrize("sq,sk,frame_tokens,runs", CAUSAL)
def test_block_causal_matches_a_dense_mask(sq, sk, frame_tokens, runs):
    """Diffusion forcing's asynchronous mode: the kernel, skipping the kv blocks after a q block and comparing block
    ids only across boundaries, gives dense block-causal attention."""
    q, k, v = inputs(1, 2, sq, sk, 64, seed=sq)
    for block_frames, q_offset in runs:
        out = causal_kernel(frame_tokens)(q, k, v, jnp.int32(block_frames), jnp.int32(q_offset))
        want = causal_reference(q, k, v, frame_tokens, block_frames, q_offset)
        assert float(np.abs(np.asarray(out) - want).max()) < FP32_ATOL, (block_frames, q_offset)


def test_block_causal_skips_the_kv_blocks_after_a_query_block() -> None:
    """The masked kv blocks are not visited: their index map points at the last block the q block needs (no new DMA)
    and the kernel body does not run; garbage in them never reaches the output."""
    blocks, d, sq = SMALL, 64, 512
    q, k, v = inputs(1, 1, sq, sq, d, seed=5)
    ft, n = 64, 2  # causal blocks of 128 tokens: q block 0 (rows 0-127) needs kv block 0 only
    k_ids = flash_tpu.block_ids(jnp.arange(sq), ft, jnp.int32(n))
    q_ids = k_ids
    qs = q * (1.0 / np.sqrt(d) * np.log2(np.e))
    garbage_k, garbage_v = k.at[:, :, 256:].set(jnp.nan), v.at[:, :, 256:].set(jnp.nan)
    out = flash_tpu._causal_call(qs.reshape(1, sq, d), garbage_k.reshape(1, sq, d), garbage_v.reshape(1, sq, d),
                                 q_ids, k_ids, blocks, sq, interpret=True)
    first = np.asarray(out.transpose(0, 2, 1)[:, :128])  # q block 0: kv block 1 (rows 256-511, NaN) never read
    assert np.isfinite(first).all()
    want = causal_reference(q, k, v, ft, n)[0, 0, :128]
    assert float(np.abs(first - want).max()) < FP32_ATOL


def test_block_causal_lowers_to_mosaic_for_tpu_at_720p() -> None:
    """The block-causal kernel lowers to Mosaic for TPU at 720p's 75,600 tokens with the default blocks."""
    fn = jax.jit(lambda q, k, v, n, off: flash_attention(q, k, v, causal=(1890, n, off)))
    x = jax.ShapeDtypeStruct((1, 2, 75_600, 128), jnp.bfloat16)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    exp = jax.export.export(fn, platforms=("tpu",))(x, x, x, i, i)
    assert "tpu_custom_call" in exp.mlir_module()
    assert exp.out_avals[0].shape == (1, 2, 75_600, 128)
