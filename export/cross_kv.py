"""Cross-attention keys and values, computed once per prompt instead of in every step.

In each of the DiT's blocks, cross-attention projects the same embedded prompt (and, for Wan 2.1
I2V/FLF2V, the same embedded CLIP image) to its keys and values at every step: with 512 text tokens
that is a quarter of a small video's step (1.3B widths at 160x96: 58 of 245 GFLOP, plus 18 for the
text embedder), though negligible at 480p. They depend on the prompt and the expert's weights only,
so a bundle holds a program per expert (`cross_kv`, `cross_kv_2`) that computes them all, and its
denoise programs take them as their `kv` input:

    kv: (layers, 2, 2B, S, inner)  keys then values of every block, for the prompt's B samples then the
                                   negative prompt's; S = image tokens (0 without CLIP) + text tokens

A cond-only step uses the first B. While a denoise program is traced, `precomputed` makes the blocks
read these instead of projecting (the projections, norm_k and the embedders return the slices or a
zero-width placeholder), so diffusers' own attention processor does the rest unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .trace import Extracted


# diffusers' WanAttnProcessor takes all but the last 512 tokens of the cross-attention input as the image's
# ("512 is the context length of the text encoder, hardcoded for now"); the split here is the same, so a bundle
# with a shorter text context (tiny test models) computes what diffusers computes too.
PROCESSOR_TEXT_TOKENS = 512


def image_tokens(tokens: int) -> int:
    """How many leading tokens of a CLIP model's `tokens` cross-attention tokens the processor treats as image."""
    return len(range(tokens)[: tokens - PROCESSOR_TEXT_TOKENS])


def _project(module: Any, context: Any, image: Any | None) -> Any:
    """torch (in the trace): (layers, 2, N, S, inner) keys and values, as diffusers' WanAttnProcessor makes them."""
    import torch

    emb = module.condition_embedder
    text = emb.text_embedder(context)
    img = None
    if image is not None:  # the model concatenates image then text tokens; the processor splits them again
        both = torch.cat([emb.image_embedder(image), text], dim=1)
        n_img = image_tokens(both.shape[1])
        img, text = both[:, :n_img], both[:, n_img:]
    out = []
    for block in module.blocks:
        a = block.attn2
        k, v = a.norm_k(a.to_k(text)), a.to_v(text)
        if img is not None:  # image tokens first, as the model concatenates them
            k = torch.cat([a.norm_added_k(a.add_k_proj(img)), k], dim=1)
            v = torch.cat([a.add_v_proj(img), v], dim=1)
        out.append(torch.stack([k, v]))
    return torch.stack(out)


def build(ex: Extracted, dtype: Any) -> Callable[..., jax.Array]:
    """fn(weights, context[, image_embeds]) -> kv in the model dtype.

    context float32 (2B, L, D): prompt embeddings then negative prompt embeddings; image_embeds float32
    (B x images, tokens, D_img), CLIP kinds only: the same image(s) for cond and uncond (repeated here)."""

    def kv(weights: dict[str, Any], context: jax.Array, image_embeds: jax.Array | None = None) -> jax.Array:
        img = None if image_embeds is None else jnp.concatenate([image_embeds] * 2).astype(dtype)
        return ex.fn(weights, (context.astype(dtype), img), {}, method=_project)

    return kv


@contextlib.contextmanager
def precomputed(module: Any, env: Any, kv: jax.Array, text_tokens: int) -> Iterator[None]:
    """While active, the DiT's blocks take their cross-attention keys and values from `kv` (layers, 2, N, S, inner;
    N the batch the model runs) and the condition embedder skips the text and image projections.

    The embedders return (N, tokens, 0) placeholders: the model still concatenates and splits them, but no one
    reads their values."""
    n, s = kv.shape[2], kv.shape[3]
    emb = module.condition_embedder
    n_img = image_tokens(s) if emb.image_embedder is not None else 0
    patched: list[Any] = []

    def returns(sub: Any, value: Any) -> None:
        sub.forward = lambda *args, **kwargs: value  # an instance attribute shadows the class's forward
        patched.append(sub)

    def placeholder(tokens: int) -> Any:
        return env.j2t_iso(jnp.zeros((n, tokens, 0), kv.dtype))

    returns(emb.text_embedder, placeholder(text_tokens))
    if emb.image_embedder is not None:
        returns(emb.image_embedder, placeholder(s - text_tokens))
    for i, block in enumerate(module.blocks):
        a = block.attn2
        k, v = env.j2t_iso(kv[i, 0, :, n_img:]), env.j2t_iso(kv[i, 1, :, n_img:])
        returns(a.to_k, k)
        returns(a.to_v, v)
        a.norm_k.forward = lambda x: x
        patched.append(a.norm_k)
        if a.add_k_proj is not None:
            returns(a.add_k_proj, env.j2t_iso(kv[i, 0, :, :n_img]))
            returns(a.add_v_proj, env.j2t_iso(kv[i, 1, :, :n_img]))
            a.norm_added_k.forward = lambda x: x
            patched.append(a.norm_added_k)
    try:
        yield
    finally:
        for sub in patched:
            del sub.forward
