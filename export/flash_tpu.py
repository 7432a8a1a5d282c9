"""Pallas TPU flash attention for Wan's long self-attention (and its cross-attention).

Why a custom kernel: at 720p / 81 frames the DiT attends over 75,600 tokens, so the
S x S score matrix can never exist; on TPU v6e the self-attention is ~2/3 of a
denoise step and bound by the VPU (the softmax), not the MXU (head dim 128 fills
only half of the 256-wide MXU). The design follows the measured TPU port in the
seeds (``seeds/002``, ``seeds/004``):

* **exp2 instead of exp.** The VPU has a native ``exp2``; ``exp`` costs an extra
  multiply per score. ``q`` is pre-multiplied by ``scale * log2(e)`` once, outside
  the kernel, and the online softmax runs in base 2 (``jnp.exp2``): softmax is
  unchanged because ``2^(x log2 e) = e^x``. Seeds: ~10% end-to-end.
* **K first in the QK^T dot.** ``dot(k, q^T)`` gives scores laid out as
  ``(kv, q)``: queries on the 128 lanes, keys on sublanes. The row statistics
  ``m`` and ``l`` are then lane vectors (``(8, block_q)``, sublane-replicated) and
  the max/sum over keys is an elementwise reduction across vregs instead of a
  cross-lane one. The accumulator is ``(D, block_q)`` too, so the kernel writes
  the output transposed, ``(B*H, D, Sq)``; one cheap XLA transpose restores
  ``(B, H, Sq, D)``.
* **Blocks** ``block_q=3328, block_kv=2816`` with an inner ``fori_loop`` over
  ``block_kv_compute=256`` keys: the best setting measured at 720p on v6e-8. The
  grid is ``(batch*heads, q blocks, kv blocks)`` with semantics
  ``("parallel", "arbitrary", "arbitrary")`` as in the seeds; the kv axis must be
  sequential because the fp32 accumulators ``m, l, acc`` live in VMEM scratch
  across it, and the output block is written on the last kv block. The seeds'
  ``XLA_TPU_FORCE_LP_LLO_SCHEDULER`` flag (better VPU/MXU overlap) is kept.
* **Ragged lengths.** 75,600 is a multiple of none of the blocks (nor is the
  512-token text context of cross-attention of ``block_kv``), so q/k/v are
  zero-padded to block multiples outside the kernel. Padded q rows are sliced off
  the output. Padded kv rows only occur in the last kv block: there the kernel
  skips the kv sub-blocks that are all padding and masks (iota compare against the
  static true length) only the one sub-block that is partly padding, so the full
  blocks pay nothing for raggedness.
* **K smoothing** (optional): subtracting the per-(batch, head) mean of K over the
  sequence shifts every score of a query by the same constant, which softmax
  ignores; it reduces the magnitude of bf16 scores.
* **Block-causal** (optional, diffusion forcing's asynchronous mode): a query sees
  the keys whose causal block of frames is not after its own. Each token's block
  id is computed outside the kernel (XLA does the integer division) and passed in,
  the queries' along lanes and the keys' along sublanes; per (q block, kv block) the
  lowest and highest ids are scalar-prefetched, so a kv block all after the q
  block's last query is skipped (its DMA too: its index map points at the last kv
  block the q block needs, already in VMEM), one all before its first query runs
  unmasked, and only the blocks across a boundary compare ids. The block size is a
  traced value: one program serves every causal_block_size.

``interpret=True`` runs the same kernel on CPU (tests); ``interpret=False`` lowers
to a Mosaic ``tpu_custom_call``, which ``jax.export`` can serialize from a
CPU-only host. On a multi-device mesh, call it inside ``jax.shard_map``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LOG2_E = math.log2(math.e)
# Finite "minus infinity": exp2(MASK_VALUE - m) underflows to 0 without inf - inf = nan.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
NUM_LANES = 128
NUM_SUBLANES = 8
# dot_general dimension numbers: contract the last dims, (kv, D) x (q, D) -> (kv, q).
_NT_DIMS = (((1,), (1,)), ((), ()))
# Contract the first dims: (kv, D) x (kv, q) -> (D, q).
_TN_DIMS = (((0,), (0,)), ((), ()))


@dataclass(frozen=True)
class FlashBlocks:
    """Block sizes: q rows per grid step, kv rows per grid step, kv rows per inner step.

    Defaults are the seeds' best at 720p on TPU v6e. ``block_q`` and
    ``block_kv_compute`` must be multiples of 128 (lane width: q is the lane axis of
    the scores and the output); ``block_kv`` a multiple of ``block_kv_compute``.
    Short sequences clamp them (:func:`fit_blocks`).
    """

    block_q: int = 3328
    block_kv: int = 2816
    block_kv_compute: int = 256

    def __post_init__(self) -> None:
        if self.block_q <= 0 or self.block_q % NUM_LANES:
            raise ValueError(f"block_q={self.block_q} must be a positive multiple of {NUM_LANES}")
        if self.block_kv_compute <= 0 or self.block_kv_compute % NUM_LANES:
            raise ValueError(f"block_kv_compute={self.block_kv_compute} must be a positive multiple of {NUM_LANES}")
        if self.block_kv <= 0 or self.block_kv % self.block_kv_compute:
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of "
                             f"block_kv_compute={self.block_kv_compute}")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def fit_blocks(blocks: FlashBlocks, q_len: int, kv_len: int) -> FlashBlocks:
    """Shrink blocks that exceed the (128-rounded) sequence, keeping the divisibility rules."""
    block_q = min(blocks.block_q, _round_up(q_len, NUM_LANES))
    block_kv_compute = min(blocks.block_kv_compute, _round_up(kv_len, NUM_LANES))
    block_kv = min(blocks.block_kv, _round_up(kv_len, block_kv_compute))
    return FlashBlocks(block_q, block_kv, block_kv_compute)


def _attend_sub_block(q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, start: jax.Array | int,
                      size: int, valid_rows: int | None, ids: tuple | None = None) -> None:
    """One online-softmax update with kv rows [start, start + size) of the current kv block.

    ``valid_rows``: if set, only the first ``valid_rows`` of these rows are real keys;
    the rest are padding and get MASK_VALUE scores. ``ids``: (queries' block ids (1, bq),
    keys' block ids (block_kv, 1)) refs: a key after a query's block is masked too.
    """
    rows = pl.ds(start, size)
    k = k_ref[rows, :]
    qk = lax.dot_general(k, q_ref[...], _NT_DIMS, preferred_element_type=jnp.float32)  # (size, bq)
    if valid_rows is not None:
        row = lax.broadcasted_iota(jnp.int32, qk.shape, 0)
        qk = jnp.where(row < valid_rows, qk, MASK_VALUE)
    if ids is not None:
        q_ids, k_ids = ids
        qk = jnp.where(k_ids[rows, :] <= q_ids[...], qk, MASK_VALUE)

    m_prev, l_prev = m_ref[...], l_ref[...]                   # (8, bq), sublane-replicated
    m_next = jnp.maximum(m_prev, qk.max(axis=0, keepdims=True))
    s = jnp.exp2(qk - m_next[0:1])                            # (size, bq)
    alpha = jnp.exp2(m_prev - m_next)
    l_ref[...] = alpha * l_prev + s.sum(axis=0, keepdims=True)
    m_ref[...] = m_next

    v = v_ref[rows, :].astype(jnp.float32)
    o_curr = lax.dot_general(v, s, _TN_DIMS, preferred_element_type=jnp.float32)  # (D, bq)
    acc_ref[...] = alpha[0:1] * acc_ref[...] + o_curr


def _attend_rows(refs: tuple, num_rows: int, step: int, masked_tail: bool, ids: tuple | None = None) -> None:
    """Online softmax over the first ``num_rows`` rows of the kv block, ``step`` rows at a time.

    With ``masked_tail`` the rows past the last full step (fewer than ``step``) are
    processed as one masked sub-block of ``step`` rows. ``ids``: block-causal, see
    ``_attend_sub_block``.
    """
    full, tail = divmod(num_rows, step)
    if full:
        def body(i: jax.Array, carry: None) -> None:
            _attend_sub_block(*refs, pl.multiple_of(i * step, step), step, None, ids)
            return carry

        lax.fori_loop(0, full, body, None, unroll=True)
    if tail and masked_tail:
        _attend_sub_block(*refs, full * step, step, tail, ids)


def _reset(m_ref, l_ref, acc_ref) -> None:
    """The online softmax's running max, sum and output, before a q block's first kv block."""
    m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)


def _flash_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
                  num_kv_blocks: int, block_kv_compute: int, last_block_rows: int) -> None:
    """Grid step (head, q block i, kv block j); ``last_block_rows`` real kv rows in the last block."""
    j = pl.program_id(2)
    block_kv = k_ref.shape[0]
    refs = (q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref)

    pl.when(j == 0)(lambda: _reset(m_ref, l_ref, acc_ref))

    if last_block_rows == block_kv:
        _attend_rows(refs, block_kv, block_kv_compute, masked_tail=False)
    else:
        @pl.when(j < num_kv_blocks - 1)
        def _full_block() -> None:
            _attend_rows(refs, block_kv, block_kv_compute, masked_tail=False)

        @pl.when(j == num_kv_blocks - 1)
        def _ragged_block() -> None:
            _attend_rows(refs, last_block_rows, block_kv_compute, masked_tail=True)

    @pl.when(j == num_kv_blocks - 1)
    def _finish() -> None:
        inv_l = 1.0 / l_ref[0:1, :]                           # (1, bq)
        o_ref[...] = (acc_ref[...] * inv_l).astype(o_ref.dtype)


def _flash_call(q: jax.Array, k: jax.Array, v: jax.Array, blocks: FlashBlocks, kv_len: int,
                interpret: bool) -> jax.Array:
    """q (N, Sq_pad, D), k/v (N, Sk_pad, D), padded to block multiples -> (N, D, Sq_pad)."""
    n, sq_pad, d = q.shape
    sk_pad = k.shape[1]
    bq, bkv = blocks.block_q, blocks.block_kv
    num_kv_blocks = sk_pad // bkv
    kernel = functools.partial(
        _flash_kernel, num_kv_blocks=num_kv_blocks, block_kv_compute=blocks.block_kv_compute,
        last_block_rows=kv_len - (num_kv_blocks - 1) * bkv)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, d, sq_pad), q.dtype),
        grid=(n, sq_pad // bq, num_kv_blocks),
        in_specs=[
            pl.BlockSpec((None, bq, d), lambda h, i, j: (h, i, 0)),
            pl.BlockSpec((None, bkv, d), lambda h, i, j: (h, j, 0)),
            pl.BlockSpec((None, bkv, d), lambda h, i, j: (h, j, 0)),
        ],
        out_specs=pl.BlockSpec((None, d, bq), lambda h, i, j: (h, 0, i)),
        scratch_shapes=[
            pltpu.VMEM((NUM_SUBLANES, bq), jnp.float32),      # m: running max (base 2)
            pltpu.VMEM((NUM_SUBLANES, bq), jnp.float32),      # l: running sum
            pltpu.VMEM((d, bq), jnp.float32),                 # acc: unnormalised output
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            flags={"XLA_TPU_FORCE_LP_LLO_SCHEDULER": True},
        ),
        interpret=interpret,
        name="wan_flash_attention",
    )(q, k, v)


def _causal_kernel(q_lo, q_hi, k_lo, k_hi, kv_last, q_ref, k_ref, v_ref, qid_ref, kid_ref, o_ref, m_ref, l_ref,
                   acc_ref, *, num_kv_blocks: int, block_kv_compute: int, last_block_rows: int) -> None:
    """`_flash_kernel`, block-causal: grid step (head, q block i, kv block j) runs only if some key of the kv block is
    visible to some query of the q block (k_lo[j] <= q_hi[i]), unmasked if every key is visible to every query
    (k_hi[j] <= q_lo[i]), else comparing the token block ids."""
    i, j = pl.program_id(1), pl.program_id(2)
    block_kv = k_ref.shape[0]
    refs = (q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref)

    pl.when(j == 0)(lambda: _reset(m_ref, l_ref, acc_ref))

    def attend(ids: tuple | None) -> None:
        if last_block_rows == block_kv:
            _attend_rows(refs, block_kv, block_kv_compute, False, ids)
            return

        @pl.when(j < num_kv_blocks - 1)
        def _full_block() -> None:
            _attend_rows(refs, block_kv, block_kv_compute, False, ids)

        @pl.when(j == num_kv_blocks - 1)
        def _ragged_block() -> None:
            _attend_rows(refs, last_block_rows, block_kv_compute, True, ids)

    runs = k_lo[j] <= q_hi[i]
    whole = k_hi[j] <= q_lo[i]

    @pl.when(runs & whole)
    def _visible() -> None:
        attend(None)

    @pl.when(runs & jnp.logical_not(whole))
    def _across() -> None:
        attend((qid_ref, kid_ref))

    @pl.when(j == num_kv_blocks - 1)
    def _finish() -> None:
        inv_l = 1.0 / l_ref[0:1, :]
        o_ref[...] = (acc_ref[...] * inv_l).astype(o_ref.dtype)


def _causal_call(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, k_ids: jax.Array, blocks: FlashBlocks,
                 kv_len: int, interpret: bool) -> jax.Array:
    """`_flash_call`, block-causal: q_ids (Sq_pad,) and k_ids (Sk_pad,) int32, each token's causal block (padded keys
    a block after every query's, padded queries any)."""
    n, sq_pad, d = q.shape
    sk_pad = k.shape[1]
    bq, bkv = blocks.block_q, blocks.block_kv
    nq, nk = sq_pad // bq, sk_pad // bkv
    qb, kb = q_ids.reshape(nq, bq), k_ids.reshape(nk, bkv)
    q_lo, q_hi, k_lo, k_hi = qb.min(axis=1), qb.max(axis=1), kb.min(axis=1), kb.max(axis=1)
    # the last kv block each q block needs (ids are non-decreasing): the blocks after it map onto it, no new DMA
    kv_last = jnp.maximum(jnp.sum(k_lo[None, :] <= q_hi[:, None], axis=1) - 1, 0).astype(jnp.int32)
    kernel = functools.partial(_causal_kernel, num_kv_blocks=nk, block_kv_compute=blocks.block_kv_compute,
                               last_block_rows=kv_len - (nk - 1) * bkv)

    def kv_map(h, i, j, ql, qh, kl, kh, last):
        return (h, jnp.minimum(j, last[i]), 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n, nq, nk),
        in_specs=[
            pl.BlockSpec((None, bq, d), lambda h, i, j, *_: (h, i, 0)),
            pl.BlockSpec((None, bkv, d), kv_map),
            pl.BlockSpec((None, bkv, d), kv_map),
            pl.BlockSpec((1, bq), lambda h, i, j, *_: (0, i)),
            pl.BlockSpec((bkv, 1), lambda h, i, j, ql, qh, kl, kh, last: (jnp.minimum(j, last[i]), 0)),
        ],
        out_specs=pl.BlockSpec((None, d, bq), lambda h, i, j, *_: (h, 0, i)),
        scratch_shapes=[
            pltpu.VMEM((NUM_SUBLANES, bq), jnp.float32),
            pltpu.VMEM((NUM_SUBLANES, bq), jnp.float32),
            pltpu.VMEM((d, bq), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, d, sq_pad), q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            flags={"XLA_TPU_FORCE_LP_LLO_SCHEDULER": True},
        ),
        interpret=interpret,
        name="wan_flash_attention_block_causal",
    )(q_lo, q_hi, k_lo, k_hi, kv_last, q, k, v, q_ids.reshape(1, sq_pad), k_ids.reshape(sk_pad, 1))


def block_ids(positions: jax.Array, frame_tokens: int, block_frames: jax.Array) -> jax.Array:
    """Each token's causal block (int32): position // frame_tokens // block_frames; all 0 when block_frames <= 1
    (full attention, as diffusers masks only for num_frame_per_block > 1)."""
    n = jnp.maximum(block_frames, 1).astype(jnp.int32)
    ids = positions.astype(jnp.int32) // frame_tokens // n
    return jnp.where(block_frames > 1, ids, 0).astype(jnp.int32)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0)))


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None,
                    blocks: FlashBlocks = FlashBlocks(), k_smoothing: bool = False,
                    interpret: bool = False, causal: tuple[int, jax.Array, jax.Array | int] | None = None
                    ) -> jax.Array:
    """q (B, H, Sq, D), k/v (B, H, Sk, D) -> (B, H, Sq, D) in q.dtype; softmax(q k^T * scale) v, no mask, or with
    `causal` = (frame_tokens, block_frames, q_offset) block-causal self-attention over frames (the queries are the
    sequence's from q_offset on, a shard of it; block_frames <= 1: no mask; see `block_ids`)."""
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q (B,H,Sq,D) and k, v (B,H,Sk,D); got {q.shape}, {k.shape}, {v.shape}")
    b, h, sq, d = q.shape
    sk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    blocks = fit_blocks(blocks, sq, sk)

    q = (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)
    if k_smoothing:
        k = (k.astype(jnp.float32) - k.astype(jnp.float32).mean(axis=2, keepdims=True)).astype(k.dtype)

    q = _pad_rows(q.reshape(b * h, sq, d), _round_up(sq, blocks.block_q))
    sk_pad = _round_up(sk, blocks.block_kv)
    k = _pad_rows(k.reshape(b * h, sk, d), sk_pad)
    v = _pad_rows(v.reshape(b * h, sk, d), sk_pad)

    if causal is None:
        out = _flash_call(q, k, v, blocks, sk, interpret)          # (B*H, D, Sq_pad)
    else:
        frame_tokens, block_frames, q_offset = causal
        big = jnp.iinfo(jnp.int32).max
        q_ids = block_ids(q_offset + jnp.arange(q.shape[1]), frame_tokens, block_frames)
        k_ids = jnp.where(jnp.arange(sk_pad) < sk, block_ids(jnp.arange(sk_pad), frame_tokens, block_frames), big)
        out = _causal_call(q, k, v, q_ids, k_ids, blocks, sk, interpret)
    return out[:, :, :sq].transpose(0, 2, 1).reshape(b, h, sq, d)
