"""AnyFlow-FAR's programs: a chunk's denoising step and the KV cache write (kinds.py "far"; runtime/far_layout.py).

AnyFlowFARTransformer3DModel (diffusers 0.42.1) runs three ways; two are wan-aot's programs:

- the step of a chunk (`_forward_inference`): the chunk's tokens at patch_size attend to themselves and to the KV
  cache, compressed slots first, then full ones, then their own; RoPE is applied to the cached keys when read (the
  cache holds them before RoPE), at their frames' positions (compressed frames on the pooled grid). diffusers' flex
  attention pads queries, keys and values to a multiple of 128 of the chunk's tokens with zeros and masks nothing:
  those zero keys get score 0 and add exp(0 - max) each to the softmax's sum. Reproduced here as that count of zero
  scores (the chunk's tokens are data: a chunk of fewer frames than the slots has fewer);
- the cache write (`_forward_cache`, mode "cache", timestep 0): the clean video so far, compressed frames through
  far_patch_embedding and full ones through patch_embedding, block-causal over chunks (a token sees its own chunk
  and earlier ones: the BlockMask of `_build_far_block_mask_from_far_cfg` without clean context; its padding to 128
  is masked, so it changes nothing), each layer's keys (after norm_k, before RoPE) and values written to the cache.

Both are traced from the module's own submodules (patch embeddings, the dual timestep embedding, the blocks with
this module's self-attention processor, the output head), the cross-attention keys and values precomputed
(export/cross_kv.py) as for every other DiT. Self-attention here is exact softmax over the whole score matrix, in
float32, masked by `frame_pos` (not the Pallas kernel: the chunk's keys are a few chunks' tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from runtime import programs as prog
from runtime import scheduler as sched
from runtime.far_layout import Layout
from runtime.kinds import DENOISE_VARIANTS, DenoiseVariant
from runtime.manifest import Geometry, TensorSpec

from . import cross_kv, sharding
from .denoise import guided_velocity, sampler_update
from .trace import Extracted, abstract_mesh

MASKED = -1e30
PAD_TO = 128  # diffusers' flex attention pads the chunk's tokens to a multiple of this
KEY_BLOCK = 2048  # the keys of one step of `attend`'s online softmax


def rope_tables(head_dim: int, max_seq_len: int, patch: tuple[int, ...], compressed_patch: tuple[int, ...],
                theta: float = 10000.0) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """AnyFlowCausalRotaryPosEmbed's rotations per axis, as (t, h, w) tables of angles' cos and sin: "full" on the
    patch_size grid (get_1d_rotary_pos_embed's theta^(-2i/d) per axis, float64), "compressed" on the
    compressed_patch_size grid (avg_pool_complex: each axis' complex exponentials averaged over its downscale and
    normalised). Each table is (positions, 2, channel pairs of the axis) float32: cos then sin."""
    hw = 2 * (head_dim // 6)
    full = []
    for d in (head_dim - 2 * hw, hw, hw):
        angles = np.outer(np.arange(max_seq_len, dtype=np.float64),
                          1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64)[: d // 2] / d))
        full.append((np.cos(angles), np.sin(angles)))
    compressed = []
    for (c, s), k in zip(full, [cp // p for cp, p in zip(compressed_patch, patch)]):
        n = len(c) // k
        pc, ps = (a[: n * k].reshape(n, k, -1).mean(axis=1) for a in (c, s))
        norm = np.sqrt(pc ** 2 + ps ** 2)
        compressed.append((pc / norm, ps / norm))
    pack = lambda tabs: tuple(np.stack([c, s], axis=1).astype(np.float32) for c, s in tabs)  # noqa: E731
    return {"full": pack(full), "compressed": pack(compressed)}


def token_rope(tables: tuple[np.ndarray, ...], frame_pos: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """The (cos, sin) of every token of the frames at `frame_pos` (F,) on a (rows, cols) grid: (2, F x rows x cols,
    head_dim / 2) float32, frame-major as the patch embedding flattens; an empty slot (-1) takes position 0."""
    t, h, w = (jnp.asarray(a) for a in tables)
    rows, cols = grid
    f = jnp.maximum(frame_pos, 0)
    ft = jnp.broadcast_to(t[f][:, None, None], (len(frame_pos), rows, cols, *t.shape[1:]))
    fh = jnp.broadcast_to(h[:rows][None, :, None], (len(frame_pos), rows, cols, *h.shape[1:]))
    fw = jnp.broadcast_to(w[:cols][None, None, :], (len(frame_pos), rows, cols, *w.shape[1:]))
    out = jnp.concatenate([ft, fh, fw], axis=-1)  # (F, rows, cols, 2, pairs)
    return jnp.moveaxis(out.reshape(-1, 2, out.shape[-1]), 1, 0)


def rotate(x: jax.Array, rope: jax.Array) -> jax.Array:
    """diffusers' apply_rotary_emb (channel pairs times the complex rotation), in float32: x (N, heads, S, D)."""
    cos, sin = rope[0][None, None], rope[1][None, None]
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    return jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape).astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, zero_keys: jax.Array | int = 0,
           block: int = KEY_BLOCK) -> jax.Array:
    """Softmax attention (N, heads, Sq, D) where `allowed` (Sq, Sk) holds, plus `zero_keys` keys of score 0 and value
    0 (diffusers' unmasked padding); a query that sees nothing gets 0. Scores and sums in float32. Over more than
    `block` keys, an online softmax over blocks of that many (the whole score matrix of a 480p chunk against its
    cache would be gigabytes per layer)."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    sk = k.shape[2]
    blocks = -(-sk // block)
    pad = blocks * block - sk
    if pad:
        k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (k, v))
        allowed = jnp.pad(allowed, ((0, 0), (0, pad)))
    kb = jnp.moveaxis(k.reshape(*k.shape[:2], blocks, block, k.shape[3]), 2, 0)
    vb = jnp.moveaxis(v.reshape(*v.shape[:2], blocks, block, v.shape[3]), 2, 0)
    ab = jnp.moveaxis(allowed.reshape(allowed.shape[0], blocks, block), 1, 0)
    has_zero = not isinstance(zero_keys, int) or zero_keys > 0
    shape = (*q.shape[:3], 1)
    m0 = jnp.full(shape, 0.0 if has_zero else MASKED, jnp.float32)  # the zero keys' score 0 counted from the start
    l0 = jnp.full(shape, 1.0, jnp.float32) * zero_keys
    acc0 = jnp.zeros(q.shape, jnp.float32)

    def one(carry: tuple[jax.Array, ...], blk: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], None]:
        m, l, acc = carry
        kk, vv, aa = blk
        s = jnp.einsum("nhqd,nhkd->nhqk", q, kk, preferred_element_type=jnp.float32) * scale
        s = jnp.where(aa[None, None], s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(aa[None, None], jnp.exp(s - m_new), 0.0)
        old = jnp.exp(m - m_new)
        acc = acc * old + jnp.einsum("nhqk,nhkd->nhqd", p, vv.astype(jnp.float32))
        return (m_new, l * old + jnp.sum(p, axis=-1, keepdims=True), acc), None

    if blocks == 1:
        (_, total, acc), _ = one((m0, l0, acc0), (kb[0], vb[0], ab[0]))
    else:
        (_, total, acc), _ = jax.lax.scan(one, (m0, l0, acc0), (kb, vb, ab))
    return (acc / jnp.maximum(total, 1e-30)).astype(q.dtype)


class _Processor:
    """The FAR self-attention of one block, as AnyFlowCausalAttnProcessor computes q, k and v; what it attends to is
    `attend_fn(q, k, v)` (the step's or the cache write's), and the keys and values before RoPE are kept in `kept`.
    With `heads` (a sharding), q, k and v are pinned to it: heads over tp, as the cache."""

    def __init__(self, env: Any, attend_fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
                 heads: Any = None) -> None:
        self.env, self.attend_fn, self.heads = env, attend_fn, heads
        self.kept: tuple[jax.Array, jax.Array] | None = None

    def __call__(self, attn: Any, hidden_states: Any, encoder_hidden_states: Any = None, attention_mask: Any = None,
                 rotary_emb: Any = None, kv_cache: Any = None, kv_cache_flag: Any = None) -> Any:
        dtype = hidden_states.dtype
        query = attn.norm_q(attn.to_q(hidden_states)).to(dtype)
        key = attn.norm_k(attn.to_k(hidden_states)).to(dtype)
        value = attn.to_v(hidden_states)
        heads = lambda x: jnp.swapaxes(self.env.t2j_iso(x.unflatten(2, (attn.heads, -1))), 1, 2)  # noqa: E731
        q, k, v = heads(query), heads(key), heads(value)
        if self.heads is not None:
            q, k, v = (jax.lax.with_sharding_constraint(a, self.heads) for a in (q, k, v))
        self.kept = (k, v)
        out = self.attend_fn(q, k, v)  # (N, heads, S, D)
        n, h, s, d = out.shape
        hidden = self.env.j2t_iso(jnp.swapaxes(out, 1, 2).reshape(n, s, h * d)).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden))


@contextlib.contextmanager
def _processors(module: Any, procs: list[_Processor]) -> Iterator[None]:
    saved = [blk.attn1.processor for blk in module.blocks]
    for blk, p in zip(module.blocks, procs):
        blk.attn1.processor = p
    try:
        yield
    finally:
        for blk, p in zip(module.blocks, saved):
            blk.attn1.processor = p


def _embed_time(module: Any, t: Any, r: Any, like: Any, tokens: int) -> tuple[Any, Any]:
    """The dual timestep embedding per token (AnyFlowDualTimestepTextImageEmbeddingCausal.forward_timestep): t, r
    (N, frames), `tokens` per frame; (temb (N, S, dim), projection (N, S, 6, dim))."""
    emb = module.condition_embedder
    delta = r if emb.deltatime_type == "r" else t - r
    temb, proj = emb.forward_timestep(t, delta, like, tokens)
    return temb, proj.unflatten(2, (6, -1))


def _grids(module: Any, h: int, w: int) -> dict[str, tuple[int, int]]:
    p, cp = module.config.patch_size, module.config.compressed_patch_size
    return {"full": (h // p[1], w // p[2]), "compressed": (h // cp[1], w // cp[2])}


def _tables(module: Any) -> dict[str, tuple[np.ndarray, ...]]:
    rope = module.rope
    return rope_tables(rope.attention_head_dim, rope.max_seq_len, tuple(module.config.patch_size),
                       tuple(module.config.compressed_patch_size), rope.theta)


def cache_layout(mesh: dict[str, int], batch: int) -> PartitionSpec:
    """The KV cache's layout (layers, 2, B', heads, tokens, head_dim): as the blocks' self-attention keys and values
    (export/sharding.py self_kv: the batch over dp where it divides, heads over tp)."""
    return PartitionSpec(None, None, *sharding.dit_layout(mesh, batch, 1).self_kv)


def build_step(ex: Extracted, order: int, dtype: Any, text_tokens: int, layout: Layout,
               variant: DenoiseVariant = DENOISE_VARIANTS["cfg"], heads: Any = None
               ) -> Callable[..., tuple[jax.Array, ...]]:
    """fn(weights, state, kv, timestep, guidance, row, full_cache, compressed_cache, frame_pos, r_timestep) ->
    (new state, all-finite flag): one flow-map step of a chunk (AnyFlowFARPipeline's inner loop body).

    state (rows, B, z, chunk, h, w) float32: the chunk's latents in the largest chunk's frames (frames past the
    chunk's are ignored); kv, timestep, guidance, row as export/denoise.py's; full_cache (layers, 2, B', heads,
    full x tokens, head_dim), compressed_cache (layers, 2, B', heads, compressed x compressed tokens, head_dim) in the
    model dtype, B' = 2B for a CFG step (the prompt's half first, as kv), B without; frame_pos int32 (compressed +
    full + chunk,): each slot's latent frame, -1 empty (runtime/far_layout.py step_positions); r_timestep float32:
    the chunk's target timestep. `heads`: the sharding q, k and v are pinned to (`cache_layout`'s, per layer)."""
    copies = 2 if variant.cfg else 1
    module, env = ex.module, ex.env
    tables = _tables(module)
    nc, nf = layout.compressed, layout.full

    def chunk(mod: Any, x: Any, t: Any, r: Any, procs: list[_Processor], blank: Any) -> Any:
        n, _, frames, h, w = x.shape
        grid = _grids(mod, h, w)["full"]
        hidden = mod.patch_embedding(x).flatten(2, 4).transpose(1, 2)
        temb, proj = _embed_time(mod, t, r, blank, grid[0] * grid[1])
        with _processors(mod, procs):
            for blk in mod.blocks:
                hidden = blk(hidden, blank, proj, None, None, {}, {})
        shift, scale = (mod.scale_shift_table + temb.unsqueeze(2)).chunk(2, dim=2)
        hidden = (mod.norm_out(hidden.float()) * (1 + scale.squeeze(2)) + shift.squeeze(2)).type_as(hidden)
        out = mod.proj_out(hidden)
        return mod._unpack_latent_sequence(out, num_frames=frames, height=h, width=w,
                                           patch_size=mod.config.patch_size[1])

    def step(weights: dict[str, Any], state: jax.Array, kv: jax.Array, timestep: jax.Array, guidance: jax.Array,
             row: jax.Array, full_cache: jax.Array, compressed_cache: jax.Array, frame_pos: jax.Array,
             r_timestep: jax.Array) -> tuple[jax.Array, ...]:
        x = state[0]
        b, _, frames, h, w = x.shape
        n = copies * b
        grids = _grids(module, h, w)
        ft, ct = (grids[g][0] * grids[g][1] for g in ("full", "compressed"))
        pos_c, pos_f, pos_own = frame_pos[:nc], frame_pos[nc:nc + nf], frame_pos[nc + nf:]
        rope_k = jnp.concatenate([token_rope(tables["compressed"], pos_c, grids["compressed"]),
                                  token_rope(tables["full"], pos_f, grids["full"]),
                                  token_rope(tables["full"], pos_own, grids["full"])], axis=1)
        rope_q = rope_k[:, (nc * ct + nf * ft):]
        key_valid = jnp.concatenate([jnp.repeat(pos_c >= 0, ct), jnp.repeat(pos_f >= 0, ft),
                                     jnp.repeat(pos_own >= 0, ft)])
        own = jnp.sum(pos_own >= 0) * ft  # the chunk's tokens: diffusers pads them to a multiple of 128 with zero keys
        zero_keys = ((own + PAD_TO - 1) // PAD_TO * PAD_TO - own).astype(jnp.float32)
        allowed = jnp.broadcast_to(key_valid[None], (frames * ft, key_valid.shape[0]))

        def layer_attend(i: int) -> Callable[..., jax.Array]:
            def fn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
                kc, kf = compressed_cache[i, :, :n], full_cache[i, :, :n]
                k_all = jnp.concatenate([kc[0], kf[0], k], axis=2)
                v_all = jnp.concatenate([kc[1], kf[1], v], axis=2)
                return attend(rotate(q, rope_q), rotate(k_all, rope_k), v_all, allowed, zero_keys)
            return fn

        procs = [_Processor(env, layer_attend(i), heads) for i in range(len(module.blocks))]
        model_in = jnp.concatenate([x] * copies).astype(dtype)
        t = jnp.full((n, frames), timestep, jnp.float32)
        r = jnp.full((n, frames), r_timestep, jnp.float32)
        blank = jnp.zeros((n, text_tokens, 0), dtype)
        with cross_kv.precomputed(module, env, kv[:, :, :n], text_tokens):
            out = ex.fn(weights, (model_in, t, r, procs, blank), {}, method=chunk)
        out = jnp.swapaxes(out, 1, 2)  # (N, F, z, h, w) -> (N, z, F, h, w)
        v = guided_velocity(out, b, guidance, variant.cfg)
        new_state = sampler_update(state, v, row, order)
        return new_state, jnp.all(jnp.isfinite(new_state[0]))

    return step


def build_cache(ex: Extracted, dtype: Any, text_tokens: int, layout: Layout,
                variant: DenoiseVariant = DENOISE_VARIANTS["cfg"], heads: Any = None
                ) -> Callable[..., tuple[jax.Array, ...]]:
    """fn(weights, latents, frame_pos, frame_chunk, kv, full_cache, compressed_cache) -> (full_cache,
    compressed_cache): AnyFlowFARPipeline.encode_kv_cache.

    latents (B, z, compressed + full, h, w) float32: the clean latent frames at their cache slots
    (runtime/far_layout.py cache_latents); frame_pos, frame_chunk int32 (compressed + full,): each slot's frame and
    chunk, -1 empty; kv the prompt's cross-attention keys and values; the caches as `build_step` takes them, returned
    rewritten (donated): every slot that holds a frame re-encoded, the empty ones as they were (never read)."""
    copies = 2 if variant.cfg else 1
    module, env = ex.module, ex.env
    tables = _tables(module)
    nc = layout.compressed

    def encode(mod: Any, x: Any, procs: list[_Processor], blank: Any) -> Any:
        import torch

        n = x.shape[0]
        comp = mod.far_patch_embedding(x[:, :, :nc]).flatten(2, 4).transpose(1, 2)
        full = mod.patch_embedding(x[:, :, nc:]).flatten(2, 4).transpose(1, 2)
        hidden = torch.cat([comp, full], dim=1)
        zeros = blank.new_zeros((n, 1), dtype=torch.float32)
        _, proj = _embed_time(mod, zeros, zeros, blank, 1)  # timestep 0 everywhere: one embedding for every token
        proj = proj.expand(n, hidden.shape[1], *proj.shape[2:])
        with _processors(mod, procs):
            for blk in mod.blocks:
                hidden = blk(hidden, blank, proj, None, None, {}, {})
        return hidden

    def write(weights: dict[str, Any], latents: jax.Array, frame_pos: jax.Array, frame_chunk: jax.Array,
              kv: jax.Array, full_cache: jax.Array, compressed_cache: jax.Array) -> tuple[jax.Array, ...]:
        b, _, _, h, w = latents.shape
        n = copies * b
        grids = _grids(module, h, w)
        ft, ct = (grids[g][0] * grids[g][1] for g in ("full", "compressed"))
        pos_c, pos_f = frame_pos[:nc], frame_pos[nc:]
        rope = jnp.concatenate([token_rope(tables["compressed"], pos_c, grids["compressed"]),
                                token_rope(tables["full"], pos_f, grids["full"])], axis=1)
        chunk = jnp.concatenate([jnp.repeat(frame_chunk[:nc], ct), jnp.repeat(frame_chunk[nc:], ft)])
        valid = chunk >= 0
        allowed = valid[None, :] & valid[:, None] & (chunk[None, :] <= chunk[:, None])

        def fn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return attend(rotate(q, rope), rotate(k, rope), v, allowed)

        procs = [_Processor(env, fn, heads) for _ in module.blocks]
        model_in = jnp.concatenate([latents] * copies).astype(dtype)
        blank = jnp.zeros((n, text_tokens, 0), dtype)
        with cross_kv.precomputed(module, env, kv[:, :, :n], text_tokens):
            ex.fn(weights, (model_in, procs, blank), {}, method=encode)
        keep = valid[None, None, None, :, None]
        kvs = jnp.stack([jnp.stack(p.kept) for p in procs])  # (layers, 2, N, heads, S, D)
        # Empty slots keep what they held (no step reads them): the cache is read, so it keeps its layout in the
        # program, and its buffers can be the outputs' (donated).
        kvs = jnp.where(keep, kvs.astype(full_cache.dtype), jnp.concatenate([compressed_cache, full_cache], axis=4))
        split = nc * ct
        return kvs[:, :, :, :, split:], kvs[:, :, :, :, :split]

    return write


def cache_specs(ex_module: Any, g: Geometry, layout: Layout, dtype: Any, cfg: bool) -> dict[str, TensorSpec]:
    """The full and compressed caches of a CFG (2B) or cond-only (B) program, in the model dtype."""
    cfg_ = ex_module.config
    _, _, _, h, w = g.latent_shape
    grids = _grids(ex_module, h, w)
    ft, ct = (grids[k][0] * grids[k][1] for k in ("full", "compressed"))
    n = (2 if cfg else 1) * g.batch
    head = (int(cfg_.num_layers), 2, n, int(cfg_.num_attention_heads))
    d = int(cfg_.attention_head_dim)
    name = np.dtype(dtype).name
    return {"full_cache": TensorSpec((*head, layout.full * ft, d), name),
            "compressed_cache": TensorSpec((*head, layout.compressed * ct, d), name)}


def export_programs(ex: Extracted, g: Geometry, config: dict[str, Any], order: int, model_dtype: Any, files: Any,
                    todo: list[Any], mesh: dict[str, int]) -> None:
    """The step and cache write programs `todo` (runtime/programs.py Program: denoise_step[_cond],
    cache_step[_cond]) of shape `g` into the bundle `files`, the caches laid out as `cache_layout`."""
    b, z, frames, h, w = g.latent_shape
    layout = Layout.of(frames, config)
    kv = files.programs[prog.Program.cross_kv().name].outputs["kv"]
    for p in todo:
        v = DENOISE_VARIANTS[p.variant]
        caches = cache_specs(ex.module, g, layout, model_dtype, v.cfg)
        n = (2 if v.cfg else 1) * b
        spec = cache_layout(mesh, n)
        parts = {"full_cache": spec, "compressed_cache": spec}
        grids = _grids(ex.module, h, w)
        tokens = (layout.chunk if p.base == prog.DENOISE else layout.full) * grids["full"][0] * grids["full"][1]
        with sharding.use_layout(sharding.dit_layout(mesh, n, tokens)):  # the blocks' and cross-attention's layout
            heads = NamedSharding(abstract_mesh(files.target), PartitionSpec(*spec[2:]))
            _export_one(ex, p, v, g, layout, order, model_dtype, files, kv, caches, parts, spec, heads)


def _export_one(ex: Extracted, p: Any, v: DenoiseVariant, g: Geometry, layout: Layout, order: int, model_dtype: Any,
                files: Any, kv: TensorSpec, caches: dict[str, TensorSpec], parts: dict[str, PartitionSpec],
                spec: PartitionSpec, heads: NamedSharding) -> None:
    """One program `p` (its variant `v`) of shape `g`, traced with `heads` the layout of its self-attention."""
    b, z, _, h, w = g.latent_shape
    L = g.max_sequence_length
    if p.base == prog.DENOISE:
        inputs = {"state": TensorSpec((sched.state_rows(order), b, z, layout.chunk, h, w), "float32"), "kv": kv,
                  "timestep": TensorSpec((), "float32"), "guidance": TensorSpec((), "float32"),
                  "row": TensorSpec((sched.row_size(order),), "float32"), **caches,
                  "frame_pos": TensorSpec((layout.compressed + layout.full + layout.chunk,), "int32"),
                  "r_timestep": TensorSpec((), "float32")}
        files.add_program(p.name, "transformer", build_step(ex, order, model_dtype, L, layout, v, heads), inputs,
                          ["state", "finite"], parts)
    else:
        slots = layout.compressed + layout.full
        inputs = {"latents": TensorSpec((b, z, slots, h, w), "float32"),
                  "frame_pos": TensorSpec((slots,), "int32"), "frame_chunk": TensorSpec((slots,), "int32"),
                  "kv": kv, **caches}
        files.add_program(p.name, "transformer", build_cache(ex, model_dtype, L, layout, v, heads), inputs,
                          list(prog.CACHE_STEP_OUTPUTS), parts, (spec, spec))

