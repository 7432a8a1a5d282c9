"""cross_kv projects a prompt's rows up to its last non-zero one, in chunks, and gives the zero padding after
it the keys and values of a zero row (export/cross_kv.py): the result must be what projecting every row
gives, whatever the padding looks like."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from export import cross_kv, tiny
from export.attention import AttentionConfig
from export.trace import extract

LENGTH = 40  # not a multiple of the chunk (10 rows here): the last chunk overlaps the one before it
# diffusers' processor takes all but the last 512 cross-attention tokens as the image's: 476 CLIP tokens and
# 40 text tokens give 4 image tokens (the added projections) and 472 that take the text projections
IMAGE_TOKENS = 476


@pytest.fixture(scope="module")
def i2v_dit():
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    module = WanTransformer3DModel(**tiny.VARIANTS["tiny-i2v"]["transformer"]).eval()
    ex = extract(module, AttentionConfig())
    weights = {k: jnp.asarray(v.detach().numpy()) for k, v in ex.weights.items()}
    return module, ex, weights


def _reference(module, context: np.ndarray, image: np.ndarray) -> np.ndarray:
    """diffusers' own modules on every row, the way WanAttnProcessor splits image and text tokens."""
    import torch

    with torch.no_grad():
        emb = module.condition_embedder
        both = torch.cat([emb.image_embedder(torch.from_numpy(image).repeat(2, 1, 1)),
                          emb.text_embedder(torch.from_numpy(context))], dim=1)
        n_img = cross_kv.image_tokens(both.shape[1])
        img, text = both[:, :n_img], both[:, n_img:]
        out = []
        for block in module.blocks:
            a = block.attn2
            k = torch.cat([a.norm_added_k(a.add_k_proj(img)), a.norm_k(a.to_k(text))], dim=1)
            v = torch.cat([a.add_v_proj(img), a.to_v(text)], dim=1)
            out.append(torch.stack([k, v]))
        return torch.stack(out).numpy()


def _rows(kv: np.ndarray) -> np.ndarray:
    """cross_kv's (layers, 2, N, heads, S, head_dim) as the projections give them: (layers, 2, N, S, inner)."""
    layers, two, n, heads, s, d = kv.shape
    return kv.swapaxes(3, 4).reshape(layers, two, n, s, heads * d)


def _context(rows_used: list[int], width: int, seed: int = 0) -> np.ndarray:
    """(2, LENGTH, width): each prompt's first `rows_used[i]` rows random, the rest zero (diffusers' padding)."""
    rng = np.random.default_rng(seed)
    ctx = np.zeros((2, LENGTH, width), np.float32)
    for i, n in enumerate(rows_used):
        ctx[i, :n] = rng.normal(size=(n, width))
    return ctx


@pytest.mark.parametrize("rows_used", [[3, 1], [0, 0], [LENGTH, 2], [12, 25], [11, 0], [31, 3], [LENGTH - 1, LENGTH]],
                         ids=["short", "empty", "full", "two-chunks", "chunk-edge", "last-clamped", "last-chunk"])
def test_chunked_projection_matches_every_row(i2v_dit, rows_used: list[int]) -> None:
    module, ex, weights = i2v_dit
    ctx = _context(rows_used, module.config.text_dim)
    image = np.random.default_rng(1).normal(size=(1, IMAGE_TOKENS, module.config.image_dim)).astype(np.float32)
    kv = np.asarray(jax.jit(cross_kv.build(ex, jnp.float32))(weights, ctx, image))
    cfg = module.config
    assert kv.shape == (cfg.num_layers, 2, 2, cfg.num_attention_heads, IMAGE_TOKENS + LENGTH, cfg.attention_head_dim)
    got, want = _rows(kv), _reference(module, ctx, image)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_zero_rows_before_the_last_used_one_are_projected_too(i2v_dit) -> None:
    """A zero row inside the prompt and a NaN row: both are projected, the NaN reaches the output."""
    module, ex, weights = i2v_dit
    ctx = _context([30, 5], module.config.text_dim)
    ctx[0, 4] = 0.0
    ctx[1, 17] = np.nan
    image = np.zeros((1, IMAGE_TOKENS, module.config.image_dim), np.float32)
    got = _rows(np.asarray(jax.jit(cross_kv.build(ex, jnp.float32))(weights, ctx, image)))
    want = _reference(module, ctx, image)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # NaNs must sit in the same places
    assert np.isnan(got[:, :, 1, -LENGTH + 17]).all() and not np.isnan(got[:, :, 1, -LENGTH + 18:]).any()
