"""A denoise step as three programs, so that the transformer block's compiled code exists once, not once per block:

    head(weights, *step inputs) -> (hidden, temb, rope)        the step up to the first block: conditioning,
                                                               patch and time embeddings, RoPE tables (stacked)
    block(block weights, hidden, temb, rope, kv, layer)        one transformer block, its cross-attention keys
        -> hidden                                              and values taken from `kv` at index `layer`; the
                                                               host runs it once per block with that block's weights
    tail(weights, *step inputs, hidden) -> the step's outputs  the step after the last block: output norm and
                                                               projection, guidance, the UniPC update (and
                                                               MagCache's residual, last block's output minus
                                                               first block's input)

The three run what the one-program step (export/denoise.py) runs, on the same values. Why split: XLA compiles
every unrolled block of a one-program step into its own code. On CPU that is 30 copies at the 1.3B widths:
loading the step's executable from the compilation cache took about 1 s and its first run 1.8-2.2 s longer
than later runs (XLA's YNNPACK fusions build their executables on first execution, one after another); as
one block program, 0.05 s and 0.3 s, the steady step unchanged (docs/why.md). Every
target compiles 1/L of the code (a 14B step on a TPU host: one block instead of 40).

The head and tail trace the whole step with the blocks replaced (export/block_cache.py): the head returns what
the first block would have been called with, the tail feeds the given hidden states out of the last block.
What they compute but do not return is dropped by the compiler.

A VACE model (WanVACETransformer3DModel) runs its VACE blocks before the main blocks, on the embedded input, and
adds hint j, times its scale, after main block vace_layers[j]. Its head runs the VACE blocks (so it takes the
shared keys and values, BlockLoop.head_takes_shared) and hands the scaled hints to the blocks as a fourth carried
value, (VACE layers, B, S, dim); block i adds hint `vace_index(module)[i]` after itself (none: -1).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from . import attention, block_cache, cross_kv
from .trace import Extracted

BLOCK_PREFIX = "blocks."  # block i of the DiT takes the group's tensors "blocks.<i>.<name>"


@dataclass
class Carry:
    """What the head hands the blocks, as the head's trace found it: the blocks' (zero-width) text placeholder
    and whether diffusers passes RoPE as a tuple (cos, sin) or one tensor."""

    placeholder: tuple[tuple[int, ...], Any] | None = None  # (shape, dtype); None until a head is traced
    rope_tuple: bool = True


HEAD_OUTPUTS = ["hidden", "temb", "rope"]
VACE_HEAD_OUTPUTS = [*HEAD_OUTPUTS, "hints"]


def vace_index(module: Any) -> list[int]:
    """For each main block, the VACE hint added after it (its position in vace_layers), or -1."""
    layers = list(module.config.vace_layers)
    return [layers.index(i) if i in layers else -1 for i in range(len(module.blocks))]


def head(ex: Extracted, step: Callable[..., Any], carry: Carry, scale_at: int | None = None,
         per_frame: bool = False, hint_sharding: Any = None) -> Callable[..., tuple[jax.Array, ...]]:
    """fn(weights, *step inputs) -> (hidden, temb, rope): the first block's arguments (RoPE's tables stacked). A VACE
    model's (`scale_at`: the position of control_scale among the step inputs) also returns its VACE blocks' hints
    times their scales, each scaled and split as `hint_sharding` says where its block makes it: stacked first, the
    8 hints of the 14B at 720p x 81 were held whole (the head needed 15.9 GiB of temporaries on tpu-v5e-8, 3.4 so).
    `per_frame` (diffusion forcing, whose blocks get a modulation per token): temb is one per latent frame,
    (B, 6, T, dim), before diffusers repeats it over each frame's tokens (`block` repeats it there): the
    (B, 6, S, dim) the blocks see would be S / T times larger (13.7 GB at 14B, 720p x 121 frames)."""

    def fn(weights: dict[str, Any], *inputs: jax.Array) -> tuple[jax.Array, ...]:
        box: dict[str, Any] = {}
        hints: list[Any] = []
        handles = frame_modulation(ex.module, box) if per_frame else []

        def first(hidden_states: Any, encoder_hidden_states: Any, temb: Any, rotary_emb: Any, *mask: Any) -> Any:
            box["args"] = (hidden_states, encoder_hidden_states, temb, rotary_emb)
            return hidden_states

        vace = scale_at is not None
        handles += [b.register_forward_hook(lambda _, args, out: hints.append(out[0]))
                    for b in (ex.module.vace_blocks if vace else [])]
        try:
            with block_cache.replace(ex.module, first, keep_vace=vace):
                step(weights, *inputs)
        finally:
            for h in handles:
                h.remove()
        hidden, text, temb, rope = ex.env.t2j_iso(box["args"])
        if per_frame:
            temb = per_frame_modulation(ex.env, box)
        carry.placeholder = (tuple(text.shape), text.dtype)
        carry.rope_tuple = isinstance(rope, (tuple, list))
        out = (hidden, temb, jnp.stack(rope if carry.rope_tuple else [rope]))
        if vace:  # as the model adds them: control_hint * scale, in the model dtype
            scale = inputs[scale_at]
            scaled = [(h * scale[j].astype(h.dtype)).astype(h.dtype) for j, h in enumerate(ex.env.t2j_iso(hints))]
            if hint_sharding is not None:
                scaled = [jax.lax.with_sharding_constraint(h, hint_sharding) for h in scaled]
            out += (jnp.stack(scaled),)
        return out

    return fn


def frame_modulation(module: Any, box: dict[str, Any]) -> list[Any]:
    """Hooks that put a SkyReels-V2 DiT's per-frame time projection (B, T, 6 x dim) into box["proj"] and its fps
    projection (1, 6 x dim) into box["fps"] (inject_sample_info models) as the forward computes them."""
    handles = [module.condition_embedder.register_forward_hook(lambda m, args, out: box.__setitem__("proj", out[1]))]
    if getattr(module, "fps_projection", None) is not None:
        handles.append(module.fps_projection.register_forward_hook(lambda m, args, out: box.__setitem__("fps", out)))
    return handles


def per_frame_modulation(env: Any, box: dict[str, Any]) -> jax.Array:
    """(B, 6, T, dim): what diffusers' diffusion forcing forward makes of the time (and fps) projections before it
    repeats them over each frame's tokens: timestep_proj.unflatten(-1, (6, -1)) (+ the fps projection's, in the model
    dtype), frames after the six modulation rows."""
    proj = env.t2j_iso(box["proj"])
    b, t, width = proj.shape
    proj = proj.reshape(b, t, 6, width // 6)
    if "fps" in box:
        proj = proj + env.t2j_iso(box["fps"]).reshape(1, 1, 6, width // 6)
    return jnp.swapaxes(proj, 1, 2)


def frame_modulated_forward(blk: Any, hidden_states: Any, encoder_hidden_states: Any, temb: Any, rotary_emb: Any,
                            attention_mask: Any = None) -> Any:
    """SkyReelsV2TransformerBlock.forward for diffusion forcing, given temb (B, 6, T, dim), one row per latent frame,
    which it repeats over each frame's tokens one modulation at a time. diffusers' model repeats temb over the tokens
    before its blocks, and the block then adds the modulation table to the whole (B, 6, T x tokens, dim) in float32:
    the compiler kept that sum. The DF-14B-720P's denoise_block_1 at 720p x 121 on tpu-v6e-8 (dp=2, tp=4: the
    tokens are not split) held 19.2 GiB of temporaries per device that way, 4.6 GiB this way (BENCHMARKS.md 11).
    The same arithmetic in the same dtypes as diffusers' block, so the same values (tests/test_skyreels.py)."""
    b, n, dim = hidden_states.shape
    frames = temb.shape[2]
    e = (blk.scale_shift_table.unsqueeze(2) + temb.float()).unsqueeze(3)  # (B, 6, T, 1, dim)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = [
        x.expand(b, frames, n // frames, dim).reshape(b, n, dim) for x in e.unbind(1)]

    norm_hidden_states = (blk.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
    attn_output = blk.attn1(norm_hidden_states, None, attention_mask, rotary_emb)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

    norm_hidden_states = blk.norm2(hidden_states.float()).type_as(hidden_states)
    hidden_states = hidden_states + blk.attn2(norm_hidden_states, encoder_hidden_states, None, None)

    norm_hidden_states = (blk.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden_states)
    ff_output = blk.ffn(norm_hidden_states)
    return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


def block(ex_block: Extracted, carry: Carry, image: bool, pad_rows: int = 0, vace: list[int] | None = None,
          per_frame: bool = False) -> Callable[..., jax.Array]:
    """fn(block weights, hidden, temb, rope[, hints], kv, layer) -> hidden: one block of the DiT whose block 0
    `ex_block` extracts (weights named as inside the block). `image`: the model has a CLIP image embedder (its keys
    and values lead each row of kv). `pad_rows`: kv is a short prompt's, its last row standing for that many zero
    rows (cross_kv.build). `vace` (`vace_index`): a VACE model's block also adds its hint. Export it after a head,
    whose trace fills `carry`."""
    if carry.placeholder is None:
        raise AssertionError("export the head before the block program")
    n_img = cross_kv.image_tokens(carry.placeholder[0][1]) if image else 0  # the placeholder spans all tokens
    # SkyReels-V2's block takes a self-attention mask (diffusers' dense block-causal one; None here: the programs
    # that need one make it in attention, export/attention.py block_causal)
    block_kwargs = {"attention_mask": None} if "attention_mask" in inspect.signature(
        type(ex_block.module).forward).parameters else {}

    def run(weights: dict[str, Any], hidden: jax.Array, temb: jax.Array, rope: jax.Array, kv: jax.Array,
            layer: jax.Array, method: Any = "forward") -> jax.Array:
        mine = jax.lax.dynamic_index_in_dim(kv, layer, 0, keepdims=False)  # (2, 2B, heads, S, head_dim)
        mine = mine[:, : hidden.shape[0]]  # a cond-only step runs the prompt's B (denoise.build)
        shape, dtype = carry.placeholder
        rotary = tuple(rope) if carry.rope_tuple else rope[0]  # tuple(array) splits the stacked axis
        with cross_kv.block_precomputed(ex_block.module, ex_block.env, mine, n_img, pad_rows):
            return ex_block.fn(weights, (hidden, jnp.zeros(shape, dtype), temb, rotary), block_kwargs, method)

    if per_frame:  # diffusion forcing: temb (B, 6, T, dim), one modulation per frame; causal_block shared
        def forcing(weights: dict[str, Any], hidden: jax.Array, temb: jax.Array, rope: jax.Array, kv: jax.Array,
                    causal_block: jax.Array, layer: jax.Array) -> jax.Array:
            causal = attention.BlockCausal(hidden.shape[1] // temb.shape[2], causal_block)
            with attention.block_causal([ex_block.module.attn1], causal):
                return run(weights, hidden, temb, rope, kv, layer, frame_modulated_forward)

        return forcing
    if vace is None:
        return run

    def with_hint(weights: dict[str, Any], hidden: jax.Array, temb: jax.Array, rope: jax.Array, hints: jax.Array,
                  kv: jax.Array, layer: jax.Array) -> jax.Array:
        out = run(weights, hidden, temb, rope, kv, layer)
        j = jnp.asarray(vace, jnp.int32)[layer]
        hint = jax.lax.dynamic_index_in_dim(hints, jnp.maximum(j, 0), 0, keepdims=False)
        return jnp.where(j >= 0, out + hint.astype(out.dtype), out)

    return with_hint


def tail(ex: Extracted, step: Callable[..., Any]) -> Callable[..., tuple[jax.Array, ...]]:
    """fn(weights, *step inputs, hidden) -> the step's outputs, `hidden` coming out of the last block."""

    def fn(weights: dict[str, Any], *args: jax.Array) -> tuple[jax.Array, ...]:
        *inputs, hidden = args
        out = ex.env.j2t_iso(hidden)
        with block_cache.replace(ex.module, lambda hidden_states, *a, **k: out):
            return step(weights, *inputs)

    return fn
