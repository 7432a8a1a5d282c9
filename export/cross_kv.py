"""Cross-attention keys and values, computed once per prompt instead of in every step.

In each of the DiT's blocks, cross-attention projects the same embedded prompt (and, for Wan 2.1
I2V/FLF2V, the same embedded CLIP image) to its keys and values at every step: with 512 text tokens
that is a quarter of a small video's step (1.3B widths at 160x96: 58 of 245 GFLOP, plus 18 for the
text embedder), though negligible at 480p. They depend on the prompt and the expert's weights only,
so a bundle holds a program per expert (`cross_kv`, `cross_kv_2`) that computes them all, and its
denoise programs take them as their `kv` input:

    kv: (layers, 2, 2B, heads, S, head_dim)  keys then values of every block, for the prompt's B samples then
                                   the negative prompt's; S = image tokens (0 without CLIP) + text tokens; a VACE
                                   model's VACE blocks follow its blocks (`attention_blocks`)

Heads before tokens is the layout attention reads them in (B, H, S, D): stored so, the blocks' split into heads
and SDPA's transpose cancel out, where keys and values stored as (S, inner) were transposed again by every
block at every step (at the 1.3B widths, 60 copies and 377 MB moved per step).

A short prompt's keys and values need not be 512 rows long: the rows after the prompt's tokens are all the
zero row's, so on CPU targets a bundle also holds programs over the first T rows of the context (T one of
kinds.text_lengths below 512) that add one row standing for the 512 - T zero rows: cross-attention gives that
row a score bias of log(512 - T) (`block_precomputed`'s `pad_rows`), which is the same softmax as 512 - T equal
rows. At the 1.3B widths and a 10-token prompt that is 65 rows instead of 512: cross_kv's output 8x smaller, and
a 128x128 step 5% faster in fp32 (5.30 s against 5.57 s), 14% in bf16 (docs/why.md).

A cond-only step uses the first B. While a denoise program is traced, `precomputed` makes the blocks
read these instead of projecting (the projections, norm_k and the embedders return the slices or a
zero-width placeholder), so diffusers' own attention processor does the rest unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .trace import Extracted

# diffusers' WanAttnProcessor takes all but the last 512 tokens of the cross-attention input as the image's
# ("512 is the context length of the text encoder, hardcoded for now"); the split here is the same, so a bundle
# with a shorter text context (tiny test models) computes what diffusers computes too.
PROCESSOR_TEXT_TOKENS = 512


def image_tokens(tokens: int) -> int:
    """How many leading tokens of a CLIP model's `tokens` cross-attention tokens the processor treats as image."""
    return len(range(tokens)[: tokens - PROCESSOR_TEXT_TOKENS])


# Text rows projected per loop iteration. Prompts are zero-padded to the text length (512 for Wan's umT5),
# and a zero row's keys and values are the same for every padded position, so the program projects the
# rows up to the last non-zero one, a chunk at a time, and gives the rest the zero row's keys and values:
# a 20-token prompt costs 1/16 of 512 rows (1.3B widths: 308 GFLOP -> about 20 per prompt pair). A chunk
# is at most a quarter of the context, so that short contexts (tiny models) save too.
TEXT_CHUNK = 32


def _kv(a: Any, x: Any, image: bool = False) -> Any:
    """torch (in the trace): a block's (2, N, r, inner) cross-attention keys and values of `x`'s rows."""
    import torch

    if image:
        return torch.stack([a.norm_added_k(a.add_k_proj(x)), a.add_v_proj(x)])
    return torch.stack([a.norm_k(a.to_k(x)), a.to_v(x)])


def attention_blocks(module: Any) -> list[Any]:
    """The blocks with a cross-attention, in kv's order: the DiT's blocks, then a VACE model's VACE blocks."""
    return [*module.blocks, *(getattr(module, "vace_blocks", None) or [])]


def _text_rows(module: Any, text: Any) -> Any:
    """torch: (layers, 2, N, r, inner) keys and values of rows that go through the text projections."""
    import torch

    return torch.stack([_kv(block.attn2, text) for block in attention_blocks(module)])


def _text(module: Any, context: Any) -> Any:
    """torch: keys and values of prompt embeddings (N, r, D_text): the text embedder, then the projections."""
    return _text_rows(module, module.condition_embedder.text_embedder(context))


def _image_embed(module: Any, image: Any) -> Any:
    return module.condition_embedder.image_embedder(image)


def _image_rows(module: Any, img: Any) -> Any:
    """torch: (layers, 2, N, r, inner) keys and values of image tokens (the added projections)."""
    import torch

    return torch.stack([_kv(block.attn2, img, image=True) for block in attention_blocks(module)])


def _heads(x: jax.Array, heads: int) -> jax.Array:
    """(..., S, inner) -> (..., heads, S, head_dim)."""
    return jnp.swapaxes(x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads), -2, -3)


def build(ex: Extracted, dtype: Any, pad_rows: int = 0) -> Callable[..., jax.Array]:
    """fn(weights, context[, image_embeds]) -> kv in the model dtype, as diffusers' WanAttnProcessor makes
    them, split into heads: (layers, 2, 2B, heads, S, head_dim), image tokens (CLIP kinds) then text tokens.

    context float32 (2B, L, D): prompt embeddings then negative prompt embeddings; image_embeds float32
    (B x images, tokens, D_img), CLIP kinds only: the same image(s) for cond and uncond (repeated here).
    With `pad_rows`, context is the first rows of embeddings that have `pad_rows` zero rows more, and kv ends
    with one row for those (the zero row's keys and values; see the module doc)."""

    heads = ex.module.config.num_attention_heads

    def project(weights: dict[str, Any], piece: jax.Array) -> jax.Array:
        return _heads(ex.fn(weights, (piece,), {}, method=_text), heads)

    def used_rows(context: jax.Array) -> jax.Array:
        """How many leading rows hold the prompts (the rest are zero; NaN counts as used)."""
        used = jnp.any(context != 0, axis=(0, 2))
        return jnp.where(jnp.any(used), context.shape[1] - jnp.argmax(used[::-1]), 0)

    def chunks(weights: dict[str, Any], context: jax.Array, out: jax.Array, chunk: int, first: Any) -> jax.Array:
        """`out` with the rows up to the last used one replaced by their keys and values, a chunk at a time from
        chunk `first` on (the last chunk overlaps the one before it)."""
        length = context.shape[1]

        def one(i: jax.Array, out: jax.Array) -> jax.Array:
            start = jnp.minimum(i * chunk, length - chunk)
            piece = jax.lax.dynamic_slice_in_dim(context, start, chunk, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(out, project(weights, piece), start, 4)

        return jax.lax.fori_loop(first, (used_rows(context) + chunk - 1) // chunk, one, out)

    def text_kv(weights: dict[str, Any], context: jax.Array) -> jax.Array:
        n, length, width = context.shape
        if length < 4:
            return project(weights, context)
        # Two zero rows, one kept: a single row makes every projection a matrix-vector product, for which XLA's
        # CPU backend materializes each weight's transpose first (60 x 9 MB held at once at the 1.3B widths).
        zero = project(weights, jnp.zeros((1, 2, width), dtype))[:, :, :, :, :1]
        out = jnp.broadcast_to(zero, (*zero.shape[:2], n, heads, length, zero.shape[-1]))
        return chunks(weights, context, out, min(TEXT_CHUNK, length // 4), 0)

    def short_text_kv(weights: dict[str, Any], context: jax.Array) -> jax.Array:
        """A short program's: the rows, then the zero row. The zero row goes through the projections with the first
        chunk, so the weights (60 x 9 MB at the 1.3B widths, packed again by every call) are read once."""
        n, length, width = context.shape
        chunk = length if length < 4 else min(TEXT_CHUNK, length // 4)
        both = project(weights, jnp.concatenate([context[:, :chunk], jnp.zeros((n, 1, width), dtype)], axis=1))
        first, zero = both[..., :chunk, :], both[..., chunk:, :]
        out = jnp.concatenate([first, jnp.broadcast_to(zero, (*zero.shape[:4], length - chunk, zero.shape[-1]))],
                              axis=4)
        return jnp.concatenate([chunks(weights, context, out, chunk, 1), zero], axis=4)

    def kv(weights: dict[str, Any], context: jax.Array, image_embeds: jax.Array | None = None) -> jax.Array:
        text = (short_text_kv if pad_rows else text_kv)(weights, context.astype(dtype))
        if image_embeds is None:
            return text
        img = ex.fn(weights, (jnp.concatenate([image_embeds] * 2).astype(dtype),), {}, method=_image_embed)
        # The model concatenates image then text tokens and the processor splits all but the last 512 off as
        # image: with a shorter text context (tiny test models) some or all image tokens take the text projections.
        n_img = image_tokens(img.shape[1] + context.shape[1] + pad_rows)
        parts = []
        if n_img:
            parts.append(_heads(ex.fn(weights, (img[:, :n_img],), {}, method=_image_rows), heads))
        if n_img < img.shape[1]:
            parts.append(_heads(ex.fn(weights, (img[:, n_img:],), {}, method=_text_rows), heads))
        return jnp.concatenate([*parts, text], axis=4)

    return kv


def _returns(sub: Any, value: Any, patched: list[Any]) -> None:
    """Make submodule `sub` return `value` (an instance attribute shadows the class's forward); noted in `patched`."""
    sub.forward = lambda *args, **kwargs: value
    patched.append(sub)


@contextlib.contextmanager
def precomputed(module: Any, env: Any, kv: jax.Array, text_tokens: int) -> Iterator[None]:
    """While active, the DiT's blocks take their cross-attention keys and values from `kv` (layers, 2, N, heads, S,
    head_dim; N the batch the model runs) and the condition embedder skips the text and image projections.

    The embedders return (N, tokens, 0) placeholders: the model still concatenates and splits them, but no one
    reads their values."""
    n, s = kv.shape[2], kv.shape[4]
    emb = module.condition_embedder
    patched: list[Any] = []

    def placeholder(tokens: int) -> Any:
        return env.j2t_iso(jnp.zeros((n, tokens, 0), kv.dtype))

    _returns(emb.text_embedder, placeholder(text_tokens), patched)
    image_embedder = getattr(emb, "image_embedder", None)  # (Helios' condition embedder has none)
    if image_embedder is not None:
        _returns(image_embedder, placeholder(s - text_tokens), patched)
    n_img = image_tokens(s) if image_embedder is not None else 0
    try:
        with contextlib.ExitStack() as stack:
            for i, block in enumerate(attention_blocks(module)):
                stack.enter_context(block_precomputed(block, env, kv[i], n_img))
            yield
    finally:
        for sub in patched:
            del sub.forward


@contextlib.contextmanager
def block_precomputed(block: Any, env: Any, kv: jax.Array, n_img: int, pad_rows: int = 0) -> Iterator[None]:
    """While active, one block's cross-attention takes its keys and values from `kv` (2, N, heads, S, head_dim):
    `n_img` image tokens first (a model with a CLIP image embedder; see `image_tokens`), then text tokens. With
    `pad_rows`, kv's last row stands for that many equal rows (`build`): its score gets log(pad_rows) added."""
    n = kv.shape[1]
    a = block.attn2
    patched: list[Any] = []
    if pad_rows:
        bias = np.zeros((1, 1, 1, kv.shape[3] - n_img), np.float32)  # a constant (.at[].set would be a scatter)
        bias[..., -1] = math.log(pad_rows)
        mask, forward = env.j2t_iso(jnp.asarray(bias)), type(a).forward
        a.forward = lambda hidden, context=None, attention_mask=None, *args, **kwargs: forward(a, hidden, context, mask,
                                                                                             *args, **kwargs)
        patched.append(a)

    def rows(x: jax.Array) -> Any:  # (N, heads, S, head_dim) -> the projections' (N, S, inner)
        return env.j2t_iso(jnp.swapaxes(x, 1, 2).reshape(n, x.shape[2], x.shape[1] * x.shape[3]))

    _returns(a.to_k, rows(kv[0, :, :, n_img:]), patched)
    _returns(a.to_v, rows(kv[1, :, :, n_img:]), patched)
    a.norm_k.forward = lambda x: x
    patched.append(a.norm_k)
    if getattr(a, "add_k_proj", None) is not None:  # (AnyFlow's attention has no image projections)
        _returns(a.add_k_proj, rows(kv[0, :, :, :n_img]), patched)
        _returns(a.add_v_proj, rows(kv[1, :, :, :n_img]), patched)
        a.norm_added_k.forward = lambda x: x
        patched.append(a.norm_added_k)
    try:
        yield
    finally:
        for sub in patched:
            del sub.forward
