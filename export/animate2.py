"""Wan-Animate 2's programs (kinds.py "animate-2"; the loop is runtime/animate2.py): the cross-attention keys and
values, the reference pass and the denoising step, traced from WanAnimate2Transformer3DModel's own submodules.

diffusers 0.42.1 (models/transformers/transformer_wan_animate_2.py) runs the DiT two ways per segment:

- the reference pass (`kv_cache_mode="extract"`): the driving segment's latents with an all-ones mask and the same
  latents again ([latents, ones (4), latents], 36 channels), at timestep 1, under the reference prompt and the CLIP
  features of the driving video's first frame; dense self-attention over its own tokens, RoPE on the reference grid
  (t + refer_offset_t, h + refer_offset_h, w + refer_offset_w, -1 meaning the grid's own size on that axis, time
  strided by refer_stride); each block's keys and values go to the cache. Here the cache holds the keys after that
  RoPE (diffusers keeps them before it and applies the same rotation when it reads them: the same numbers, once);
- the step (`"cached"`): the segment's noisy latents [latents, mask, condition] over L + 1 latent frames (the first
  the character image's), RoPE from position 0; each query of frame f attends to every token of the segment and,
  for f >= 1, to the cached reference tokens of driving frame f - 1 (diffusers' flex BlockMask; its padding to 128 is
  masked, so it changes nothing). Here that is one softmax over the two key sets: queries in blocks of one frame
  (or less), each block's softmax started from its frame's reference keys and run online over the segment's keys in
  blocks (`_local`), so a layer's temporaries are a block's scores, not the segment's. The unconditional branch
  of CFG skips block 9 (`is_uncondtion`): in the CFG program the second half's rows keep block 9's input.

Cross-attention is WanAnimate2CrossAttnProcessor's: the text (padded to text_len, all rows attended) and the CLIP
image tokens (img_emb, then add_k/v with norm_added_k) as two softmaxes, summed; their keys and values come from the
`cross_kv` program ((layers, 2, 2B, heads, image + text tokens, head_dim)), the reference pass takes its first B rows
(the reference prompt's, computed with the driving frame's CLIP features). Attention scores and sums are float32.

On a mesh the programs are laid out as the Wan DiT's (export/sharding.py `current_layout`): the hidden states pinned
at every block (the batch over dp, the tokens over sp; or the tokens over (dp, sp) without CFG), attention inside
shard_map with heads over tp and queries over the sequence axes, keys whole; the reference cache's tokens split as
the reference pass's activations (`cache_layout`), each block's gathered when the step reads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from runtime import programs as prog
from runtime import scheduler as sched
from runtime.errors import UserError
from runtime.kinds import DENOISE_VARIANTS, DenoiseVariant
from runtime.manifest import Geometry, TensorSpec

from . import sharding
from .denoise import guided_velocity, sampler_update
from .sharding import DitLayout
from .trace import Extracted, abstract_mesh

MASKED = -1e30
KEY_BLOCK = 2048  # keys per step of the online softmax over a segment's tokens
QUERY_BLOCK = 4096  # at most this many queries at a time (720p: one latent frame, 3600 tokens)
SKIPPED_UNCOND_BLOCK = 9  # WanAnimate2Transformer3DModel.forward: `if is_uncondtion and idx == 9: continue`


# -- RoPE ----------------------------------------------------------------------------------------------------------
def _axis_angles(dim: int, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """rope_params' angles (float64) of `positions` for one axis of `dim` channels: (len, dim / 2)."""
    return np.outer(positions.astype(np.float64), 1.0 / np.power(theta, np.arange(0, dim, 2, dtype=np.float64) / dim))


def rope(head_dim: int, grid: tuple[int, int, int], offsets: tuple[int, int, int], stride: int = 1) -> np.ndarray:
    """(2, F x h x w, head_dim / 2) float32: cos and sin of each token's rotation (frame-major, as patch_embedding
    flattens), rope_apply's split of the channel pairs into time (d/2 - 2 (d/2 // 3)), height and width (d/2 // 3
    each) with rope_params' per-axis dims d - 4 (d // 6), 2 (d // 6), 2 (d // 6); time positions strided."""
    f, h, w = grid
    d3 = 2 * (head_dim // 6)
    t = _axis_angles(head_dim - 2 * d3, offsets[0] + stride * np.arange(f))
    y = _axis_angles(d3, offsets[1] + np.arange(h))
    x = _axis_angles(d3, offsets[2] + np.arange(w))
    angles = np.concatenate([np.broadcast_to(t[:, None, None], (f, h, w, t.shape[1])),
                             np.broadcast_to(y[None, :, None], (f, h, w, y.shape[1])),
                             np.broadcast_to(x[None, None, :], (f, h, w, x.shape[1]))], axis=-1).reshape(f * h * w, -1)
    return np.stack([np.cos(angles), np.sin(angles)]).astype(np.float32)


def reference_offsets(config: Any, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """refer_offset_t/h/w, each -1 resolved to the reference grid's size on that axis (the model's forward)."""
    given = (config.refer_offset_t, config.refer_offset_h, config.refer_offset_w)
    return tuple(int(o) if o >= 0 else int(grid[a]) for a, o in enumerate(given))  # type: ignore[return-value]


def rotate(x: jax.Array, table: jax.Array) -> jax.Array:
    """rope_apply: consecutive channel pairs times the complex rotation, in float32; x (N, heads, S, D)."""
    cos, sin = table[0][None, None], table[1][None, None]
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    return jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape).astype(x.dtype)


# -- attention -----------------------------------------------------------------------------------------------------
def _query_block(tokens: int, local: int) -> int:
    """The queries per block of a device's `local` queries: the largest divisor of both the tokens per frame and
    `local` up to QUERY_BLOCK, so that every block lies in one latent frame (shards start on a block boundary)."""
    g = math.gcd(tokens, local)
    return max(d for d in range(1, min(g, QUERY_BLOCK) + 1) if g % d == 0)


def _local(q: jax.Array, k: jax.Array, v: jax.Array, k_ref: jax.Array | None, v_ref: jax.Array | None,
           tokens: int, offset: Any, ref_rows: Any, block_q: int, block_k: int = KEY_BLOCK) -> jax.Array:
    """One device's self-attention: q (n, H, Sq, D), its queries at global positions `offset` + index; k, v
    (n, H, Sk, D) every key of the segment. With k_ref, v_ref ((B, H, (F - 1) x tokens, D), every reference frame,
    the rows of q's batch `ref_rows`), the queries of frame f >= 1 also see reference frame f - 1: one softmax over
    both. Queries in blocks of `block_q` (each in one frame), keys in blocks of `block_k`: a block's (max, sum,
    weighted values) starts from its frame's reference softmax, then runs online over the segment's key blocks.
    Scores and sums float32."""
    n, h, sq, d = q.shape
    scale = 1.0 / np.sqrt(d)
    sk = k.shape[2]
    size = min(block_k, sk)
    blocks = -(-sk // size)
    pad = blocks * size - sk
    if pad:
        k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (k, v))
    valid = (jnp.arange(blocks * size) < sk).reshape(blocks, size)
    kb = jnp.moveaxis(k.reshape(n, h, blocks, size, d), 2, 0)
    vb = jnp.moveaxis(v.reshape(n, h, blocks, size, d), 2, 0)
    nq = sq // block_q
    qb = jnp.moveaxis(q.reshape(n, h, nq, block_q, d), 2, 0)

    def one_key_block(carry: tuple[jax.Array, ...], blk: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], None]:
        qq, m, total, acc = carry
        kk, vv, ok = blk
        s = jnp.einsum("nhqd,nhkd->nhqk", qq, kk, preferred_element_type=jnp.float32) * scale
        s = jnp.where(ok[None, None, None], s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.exp(s - m_new)
        old = jnp.exp(m - m_new)
        acc = acc * old + jnp.einsum("nhqk,nhkd->nhqd", p, vv.astype(jnp.float32))
        return (qq, m_new, total * old + jnp.sum(p, axis=-1, keepdims=True), acc), None

    def one_query_block(args: tuple[jax.Array, ...]) -> jax.Array:
        qq, i = args
        shape = (n, h, block_q, 1)
        m = jnp.full(shape, MASKED, jnp.float32)
        total = jnp.zeros(shape, jnp.float32)
        acc = jnp.zeros((n, h, block_q, d), jnp.float32)
        if k_ref is not None:
            f = (offset + i * block_q) // tokens  # the block's frame
            start = jnp.maximum(f - 1, 0) * tokens
            kr = jnp.take(jax.lax.dynamic_slice_in_dim(k_ref, start, tokens, axis=2), ref_rows, axis=0)
            vr = jnp.take(jax.lax.dynamic_slice_in_dim(v_ref, start, tokens, axis=2), ref_rows, axis=0)
            s = jnp.einsum("nhqd,nhkd->nhqk", qq, kr, preferred_element_type=jnp.float32) * scale
            mr = jnp.max(s, axis=-1, keepdims=True)
            p = jnp.exp(s - mr)
            seen = f >= 1
            m = jnp.where(seen, mr, m)
            total = jnp.where(seen, jnp.sum(p, axis=-1, keepdims=True), total)
            acc = jnp.where(seen, jnp.einsum("nhqk,nhkd->nhqd", p, vr.astype(jnp.float32)), acc)
        init = (qq, m, total, acc)
        if blocks == 1:
            out, _ = one_key_block(init, (kb[0], vb[0], valid[0]))
        else:
            out, _ = jax.lax.scan(one_key_block, init, (kb, vb, valid))
        return out[3] / out[2]

    out = jax.lax.map(one_query_block, (qb, jnp.arange(nq)))  # (nq, n, H, block_q, D)
    return jnp.moveaxis(out, 0, 2).reshape(n, h, sq, d).astype(q.dtype)


def _index(mesh: AbstractMesh, axes: tuple[str, ...]) -> Any:
    """This device's index along `axes` (major first), inside shard_map."""
    index = 0
    for a in axes:
        index = index * mesh.shape[a] + jax.lax.axis_index(a)
    return index


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, mesh: AbstractMesh, tokens: int,
                   k_ref: jax.Array | None = None, v_ref: jax.Array | None = None) -> jax.Array:
    """Self-attention laid out as the Wan DiT's (export/sharding.py `current_layout`): inside shard_map, q (N, H, S,
    D) with heads over tp and queries over the layout's sequence axes, the keys whole on the sequence; the reference
    keys (B, H, (F - 1) x tokens, D) of the step (the reference pass has none) gathered whole on their tokens, q's
    rows taking reference row (row % B). `_local` on each device."""
    layout = sharding.current_layout()
    n, _, s, _ = q.shape
    pieces = math.prod(mesh.shape[a] for a in layout.seq)
    rows = n // math.prod(mesh.shape[a] for a in layout.batch)
    local = s // pieces
    block_q = _query_block(tokens, local)
    q_spec, kv_spec = layout.self_q, layout.self_kv
    if k_ref is None:
        def fn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return _local(q, k, v, None, None, tokens, _index(mesh, layout.seq) * local, None, block_q)

        return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                             check_vma=False)(q, k, v)
    b = k_ref.shape[0]
    ref_spec = PartitionSpec(None, "tp", None, None)

    def fn_ref(q: jax.Array, k: jax.Array, v: jax.Array, kr: jax.Array, vr: jax.Array) -> jax.Array:
        ref_rows = (_index(mesh, layout.batch) * rows + jnp.arange(rows)) % b
        return _local(q, k, v, kr, vr, tokens, _index(mesh, layout.seq) * local, ref_rows, block_q)

    return jax.shard_map(fn_ref, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ref_spec, ref_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v, k_ref, v_ref)


def _plain(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention over a few keys (cross-attention's), float32 scores: (N, H, Sq, D) float32."""
    s = jnp.einsum("nhqd,nhkd->nhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("nhqk,nhkd->nhqd", p, v.astype(jnp.float32))


def cross_attention(q: jax.Array, kv: jax.Array, image_tokens: int, mesh: AbstractMesh) -> jax.Array:
    """WanAnimate2CrossAttnProcessor's two softmaxes (text; CLIP image tokens, first in kv (2, N, H, tokens, D)),
    summed, laid out as the self-attention's queries (heads over tp, queries over the sequence axes), the keys whole,
    the queries in blocks of QUERY_BLOCK (padded)."""
    layout = sharding.current_layout()
    q_spec = layout.self_q
    kv_spec = PartitionSpec(None, *layout.self_kv)

    def fn(q: jax.Array, kv: jax.Array) -> jax.Array:
        n, h, sq, d = q.shape
        block = min(QUERY_BLOCK, sq)
        nq = -(-sq // block)
        qp = jnp.pad(q, ((0, 0), (0, 0), (0, nq * block - sq), (0, 0)))
        qb = jnp.moveaxis(qp.reshape(n, h, nq, block, d), 2, 0)

        def one(qq: jax.Array) -> jax.Array:
            att = _plain(qq, kv[0, :, :, image_tokens:], kv[1, :, :, image_tokens:]).astype(q.dtype)
            if image_tokens:
                att = att + _plain(qq, kv[0, :, :, :image_tokens], kv[1, :, :, :image_tokens]).astype(q.dtype)
            return att

        out = jax.lax.map(one, qb)
        return jnp.moveaxis(out, 0, 2).reshape(n, h, nq * block, d)[:, :, :sq]

    return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec), out_specs=q_spec, check_vma=False)(q, kv)


# -- the model -----------------------------------------------------------------------------------------------------
class _Model:
    """WanAnimate2Transformer3DModel's forward, its attention in JAX (the functions above)."""

    def __init__(self, ex: Extracted, mesh: AbstractMesh) -> None:
        self.ex, self.env = ex, ex.env
        cfg = ex.module.config
        self.heads = int(cfg.num_heads)
        self.head_dim = int(cfg.dim) // self.heads
        self.image_tokens = 0
        self.mesh = mesh

    def pin(self, x: jax.Array, spec: PartitionSpec) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _split(self, x: Any) -> jax.Array:
        """torch (N, S, dim) -> jax (N, heads, S, head_dim), pinned as the layout's queries (heads over tp, the
        sequence over its axes)."""
        out = jnp.swapaxes(self.env.t2j_iso(x.unflatten(2, (self.heads, -1))), 1, 2)
        return self.pin(out, sharding.current_layout().self_q)

    def _hidden(self, x: Any) -> Any:
        """torch (N, S, dim) pinned as the layout's hidden states (the batch and the sequence over theirs)."""
        return self.env.j2t_iso(self.pin(self.env.t2j_iso(x), sharding.current_layout().hidden))

    def _merge(self, x: jax.Array, like: Any) -> Any:
        n, h, s, d = x.shape
        return self.env.j2t_iso(jnp.swapaxes(x, 1, 2).reshape(n, s, h * d)).type_as(like)

    def embed_time(self, mod: Any, t: Any) -> tuple[Any, Any]:
        temb = mod.time_embedding(mod.timesteps_proj(t).to(dtype=next(mod.time_embedding.parameters()).dtype))
        return temb, mod.time_projection(temb).unflatten(1, (6, int(mod.config.dim)))

    def blocks(self, mod: Any, hidden: Any, proj: Any, kv: jax.Array, image_tokens: int,
               self_attend: Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array], uncond_from: int | None
               ) -> Any:
        """Every block on `hidden` (N, S, dim); `self_attend(i, q, k, v)` is block i's self-attention (q, k, v before
        RoPE); rows from `uncond_from` on keep block 9's input (CFG's unconditional half)."""
        import torch

        if uncond_from is not None:
            uncond = self.env.j2t_iso(jnp.arange(hidden.shape[0]).reshape(-1, 1, 1) >= uncond_from)
        for i, blk in enumerate(mod.blocks):
            hidden = self._hidden(hidden)
            before = hidden
            shift, scale, gate, c_shift, c_scale, c_gate = (blk.modulation + proj).chunk(6, dim=1)
            norm = (blk.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)
            a = blk.self_attn
            out = self_attend(i, self._split(a.norm_q(a.to_q(norm))), self._split(a.norm_k(a.to_k(norm))),
                              self._split(a.to_v(norm)))
            hidden = (hidden.float() + a.to_out[0](self._merge(out, norm)) * gate).type_as(hidden)
            c = blk.cross_attn
            normed = blk.norm3(hidden.float()).type_as(hidden)
            q = self._split(c.norm_q(c.to_q(normed)))
            att = cross_attention(q, kv[i], image_tokens, self.mesh)  # kv[i]: (2, N, heads, tokens, head_dim)
            hidden = hidden + c.to_out[0](self._merge(att, normed))
            norm = (blk.norm2(hidden.float()) * (1 + c_scale) + c_shift).type_as(hidden)
            hidden = (hidden.float() + blk.ffn(norm).float() * c_gate).type_as(hidden)
            if uncond_from is not None and i == SKIPPED_UNCOND_BLOCK:
                hidden = torch.where(uncond, before, hidden)
        return self._hidden(hidden)


def check_text(module: Any, max_sequence_length: int) -> None:
    """The DiT pads the prompt to its text_len and takes no longer one (diffusers fails on it): refuse a longer
    --max-sequence-length in one line."""
    text_len = int(module.config.text_len)
    if max_sequence_length > text_len:
        raise UserError(f"this Wan-Animate 2 DiT takes prompts of at most {text_len} tokens (its text_len): export "
                        f"with --max-sequence-length {text_len} or less")


def build_cross_kv(ex: Extracted, dtype: Any) -> Callable[..., jax.Array]:
    """fn(weights, context (2B, L, D) float32, image_embeds (B, tokens, 1280) float32) -> kv (layers, 2, 2B, heads,
    tokens + text_len, head_dim) in the model dtype: each block's cross-attention keys (after norm_k / norm_added_k)
    and values, the image's tokens first (the same image for both halves)."""
    module = ex.module
    heads = int(module.config.num_heads)
    text_len = int(module.config.text_len)

    def project(mod: Any, context: Any, image: Any) -> Any:
        import torch

        if context.shape[1] < text_len:  # the model pads the prompt to text_len with zeros
            context = torch.cat([context, context.new_zeros(context.shape[0], text_len - context.shape[1],
                                                            context.shape[2])], dim=1)
        text = mod.text_embedding(context)
        img = mod.img_emb(image)
        img = img.repeat(text.shape[0] // img.shape[0], 1, 1)
        out = []
        for blk in mod.blocks:
            c = blk.cross_attn
            k = torch.cat([c.norm_added_k(c.add_k_proj(img)), c.norm_k(c.to_k(text))], dim=1)
            v = torch.cat([c.add_v_proj(img), c.to_v(text)], dim=1)
            out.append(torch.stack([k, v]))
        return torch.stack(out)

    def fn(weights: dict[str, Any], context: jax.Array, image_embeds: jax.Array) -> jax.Array:
        kv = ex.fn(weights, (context.astype(dtype), image_embeds.astype(dtype)), {}, method=project)
        return jnp.swapaxes(kv.reshape(*kv.shape[:-1], heads, kv.shape[-1] // heads), -2, -3).astype(dtype)

    return fn


def build_reference(ex: Extracted, dtype: Any, text_tokens: int, mesh: AbstractMesh,
                    cache: PartitionSpec = PartitionSpec()) -> Callable[..., jax.Array]:
    """fn(weights, reference (B, 36, L, h, w) float32, kv, ref_cache) -> ref_cache: the reference pass
    (kv_cache_mode "extract") of a driving segment, each block's keys (after the reference RoPE) and values,
    (layers, 2, B, heads, L x h/2 x w/2, head_dim) in the model dtype, laid out as `cache` (`cache_layout`); the
    cache given is overwritten (donated), a block at a time."""
    model = _Model(ex, mesh)
    per_block = PartitionSpec(*cache[2:])

    def extract(mod: Any, x: Any, kv: jax.Array, image_tokens: int) -> Any:
        import torch

        hidden = mod.patch_embedding(x)
        grid = tuple(int(s) for s in hidden.shape[2:])
        hidden = hidden.flatten(2).transpose(1, 2)
        offsets = reference_offsets(mod.config, grid)
        table = jnp.asarray(rope(model.head_dim, grid, offsets, int(mod.config.refer_stride)))
        _, proj = model.embed_time(mod, x.new_ones(x.shape[0], dtype=torch.float32))  # the fixed timestep 1
        tokens = grid[1] * grid[2]
        kept: list[tuple[jax.Array, jax.Array]] = []

        def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            q, k = rotate(q, table), rotate(k, table)
            kept.append((model.pin(k, per_block), model.pin(v, per_block)))
            return self_attention(q, k, v, mesh, tokens)

        model.blocks(mod, hidden, proj, kv, image_tokens, attend, None)
        return kept

    def fn(weights: dict[str, Any], reference: jax.Array, kv: jax.Array, ref_cache: jax.Array) -> jax.Array:
        b = reference.shape[0]
        image_tokens = kv.shape[4] - text_tokens
        kept: list[Any] = []

        def run(mod: Any, x: Any) -> Any:
            kept.extend(extract(mod, x, kv[:, :, :b], image_tokens))
            return x

        ex.fn(weights, (reference.astype(dtype),), {}, method=run)
        for i, (k, v) in enumerate(kept):
            ref_cache = ref_cache.at[i, 0].set(k.astype(ref_cache.dtype)).at[i, 1].set(v.astype(ref_cache.dtype))
        return model.pin(ref_cache, cache)

    return fn


def build_step(ex: Extracted, order: int, dtype: Any, text_tokens: int,
               variant: DenoiseVariant = DENOISE_VARIANTS["cfg"], mesh: AbstractMesh | None = None
               ) -> Callable[..., tuple]:
    """fn(weights, state, kv, timestep, guidance, row, condition, ref_cache) -> (new state, all-finite flag): one
    step of a segment (WanAnimate2SegmentDenoiseInner's body). state (rows, B, z, L + 1, h, w) float32; condition
    (B, 4 + z, L + 1, h, w) float32: the character image's mask and latents, then the carried frames'; ref_cache as
    `build_reference` returns it; kv, timestep, guidance, row as export/denoise.py's."""
    copies = 2 if variant.cfg else 1
    module = ex.module
    model = _Model(ex, mesh)
    p = tuple(int(s) for s in module.config.patch_size)

    def forward(mod: Any, x: Any, t: Any, kv: jax.Array, cache: jax.Array, image_tokens: int, b: int) -> Any:
        n = x.shape[0]
        hidden = mod.patch_embedding(x)
        grid = tuple(int(s) for s in hidden.shape[2:])
        hidden = hidden.flatten(2).transpose(1, 2)
        tokens = grid[1] * grid[2]
        table = jnp.asarray(rope(model.head_dim, grid, (0, 0, 0)))
        temb, proj = model.embed_time(mod, t)

        def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            # cache: (layers, 2, B, H, S_ref, D); the N = copies x B rows of q take row (row % B)
            return self_attention(rotate(q, table), rotate(k, table), v, mesh, tokens, cache[i, 0], cache[i, 1])

        hidden = model.blocks(mod, hidden, proj, kv, image_tokens, attend, b if copies > 1 else None)
        head = mod.head
        shift, scale = (head.modulation + temb.float().unsqueeze(1)).chunk(2, dim=1)
        out = head.head((head.norm(hidden.float()) * (1 + scale) + shift).type_as(hidden))
        f, hh, ww = grid
        out = out.view(n, f, hh, ww, p[0], p[1], p[2], -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.reshape(n, out.shape[1], f * p[0], hh * p[1], ww * p[2]).float()

    def step(weights: dict[str, Any], state: jax.Array, kv: jax.Array, timestep: jax.Array, guidance: jax.Array,
             row: jax.Array, condition: jax.Array, ref_cache: jax.Array) -> tuple[jax.Array, ...]:
        x = state[0]
        b = x.shape[0]
        n = copies * b
        image_tokens = kv.shape[4] - text_tokens
        model_in = jnp.concatenate([jnp.concatenate([x, condition], axis=1)] * copies).astype(dtype)
        t = jnp.full((n,), timestep, jnp.float32)
        kvn = kv[:, :, :n]

        def run(mod: Any, xx: Any, tt: Any) -> Any:
            return forward(mod, xx, tt, kvn, ref_cache, image_tokens, b)

        out = ex.fn(weights, (model_in, t), {}, method=run)
        v = guided_velocity(out, b, guidance, variant.cfg)
        new_state = sampler_update(state, v, row, order)
        return new_state, jnp.all(jnp.isfinite(new_state[0]))

    return step


# -- the programs --------------------------------------------------------------------------------------------------
def reference_tokens(module: Any, g: Geometry) -> int:
    """The reference tokens of a segment of shape `g`: its latent frames (without the image's slot) x patches."""
    p = module.config.patch_size
    return g.latent_frames * (g.latent_height // p[1]) * (g.latent_width // p[2])


def cache_spec(module: Any, g: Geometry, dtype: Any) -> TensorSpec:
    cfg = module.config
    heads = int(cfg.num_heads)
    return TensorSpec((int(cfg.num_layers), 2, g.batch, heads, reference_tokens(module, g), int(cfg.dim) // heads),
                      np.dtype(dtype).name)


def cache_layout(mesh: dict[str, int], batch: int, tokens: int) -> PartitionSpec:
    """The reference cache's layout (layers, 2, B, heads, tokens, head_dim): as the reference pass's activations
    (export/sharding.py `dit_layout` of B samples of `tokens`: the batch over dp where it divides, else the tokens
    over (dp, sp) where they divide), heads over tp. Each block's keys and values are gathered whole on their tokens
    when the step's attention reads them."""
    layout = sharding.dit_layout(mesh, batch, tokens)
    return PartitionSpec(None, None, layout.batch_spec[0], "tp", DitLayout._axes(layout.seq), None)


def export_programs(ex: Extracted, g: Geometry, order: int, model_dtype: Any, files: Any, todo: list[Any],
                    mesh: dict[str, int], text_tokens: int) -> None:
    """The reference pass and step programs `todo` (runtime/programs.py Program: reference_step, denoise_step,
    denoise_step_cond) of shape `g` into the bundle `files`; the cache laid out as `cache_layout`."""
    b, z, frames, h, w = g.latent_shape
    kv = files.programs[prog.Program.cross_kv().name].outputs["kv"]
    cache = cache_spec(ex.module, g, model_dtype)
    spec = cache_layout(mesh, b, reference_tokens(ex.module, g))
    parts = {"ref_cache": spec}
    amesh = abstract_mesh(files.target)
    tokens = frames * (h // 2) * (w // 2)
    mask = g.temporal_scale
    for p in todo:
        if p.base == prog.REFERENCE_STEP:
            inputs = {"reference": TensorSpec((b, 2 * z + mask, g.latent_frames, h, w), "float32"), "kv": kv,
                      "ref_cache": cache}
            with sharding.use_layout(sharding.dit_layout(mesh, b, reference_tokens(ex.module, g))):
                files.add_program(p.name, "transformer", build_reference(ex, model_dtype, text_tokens, amesh, spec),
                                  inputs, list(prog.REFERENCE_STEP_OUTPUTS), parts, spec)
            continue
        v = DENOISE_VARIANTS[p.variant]
        inputs = {"state": TensorSpec((sched.state_rows(order), b, z, frames, h, w), "float32"), "kv": kv,
                  "timestep": TensorSpec((), "float32"), "guidance": TensorSpec((), "float32"),
                  "row": TensorSpec((sched.row_size(order),), "float32"),
                  "condition": TensorSpec((b, mask + z, frames, h, w), "float32"), "ref_cache": cache}
        with sharding.use_layout(sharding.dit_layout(mesh, (2 if v.cfg else 1) * b, tokens)):
            files.add_program(p.name, "transformer", build_step(ex, order, model_dtype, text_tokens, v, amesh),
                              inputs, ["state", "finite"], parts)
