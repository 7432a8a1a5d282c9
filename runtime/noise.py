"""Initial noise of segmented runs (runtime/animate.py, runtime/forcing.py): given per segment, or from the seed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import UserError


def seed_noise(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Segment `index`'s noise from `seed`: the first is what a one-segment run draws (Pipeline.initial_latents)."""
    key = jax.random.key(seed)
    if index:
        key = jax.random.fold_in(key, index)
    return np.asarray(jax.random.normal(key, shape, jnp.float32))


def segment_noise(latents: Any, count: int, shape: tuple[int, ...] | list[tuple[int, ...]]) -> list[np.ndarray | None]:
    """The initial noise of each segment: `latents` is None (every segment's from the seed), one array (the first
    segment's, as diffusers' `latents`) or a list of one per segment. `shape`: every segment's, or a list of each
    one's (diffusion forcing's last segment may be shorter)."""
    shapes = list(shape) if isinstance(shape, list) else [shape] * count
    if latents is None:
        return [None] * count
    given = list(latents) if isinstance(latents, (list, tuple)) else [latents]
    if isinstance(latents, (list, tuple)) and len(given) != count:
        raise UserError(f"latents: give one initial noise per segment ({count} here), or one array for the first "
                        f"segment; got {len(given)}")
    out: list[np.ndarray | None] = []
    for i, x in enumerate(given):
        a = np.asarray(x, np.float32)
        if a.shape != tuple(shapes[i]) or not np.isfinite(a).all():
            raise UserError(f"latents {i}: must be finite, of shape {list(shapes[i])} (got {list(a.shape)})")
        out.append(a)
    return out + [None] * (count - len(out))
