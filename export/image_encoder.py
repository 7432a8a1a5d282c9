"""Stage `image_encoder`: CLIP vision pixels -> the penultimate layer's hidden states (Wan 2.1 I2V, FLF2V).

diffusers' WanImageToVideoPipeline.encode_image passes `hidden_states[-2]` to the DiT's
image cross-attention; the pixels are preprocessed on the host (runtime/images.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .trace import Extracted


def build(ex: Extracted, dtype: Any) -> Callable[..., jax.Array]:
    """fn(weights, pixel_values float32 (N, 3, S, S)) -> float32 (N, tokens, hidden)."""

    def encode(weights: dict[str, Any], pixels: jax.Array) -> jax.Array:
        out = ex.fn(weights, (pixels.astype(dtype),), {"output_hidden_states": True, "return_dict": False})
        hidden_states = out[2]  # (last_hidden_state, pooler_output, hidden_states)
        return hidden_states[-2].astype(jnp.float32)

    return encode
