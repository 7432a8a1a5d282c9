"""Stage `text_encoder`: token ids + mask -> UMT5 embeddings with padded positions zeroed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .trace import Extracted


def build(ex: Extracted) -> Callable[..., jax.Array]:
    """fn(weights, ids int32 (N, L), mask int32 (N, L)) -> float32 (N, L, D).

    diffusers keeps only the first `mask.sum()` rows of `last_hidden_state` and pads
    with zeros; with right padding that is the same as zeroing masked rows.
    """

    def encode(weights: dict[str, Any], ids: jax.Array, mask: jax.Array) -> jax.Array:
        hidden = ex.fn(weights, (ids, mask), {"return_dict": False})[0]
        return jnp.where(mask[..., None] > 0, hidden.astype(jnp.float32), 0.0)

    return encode
