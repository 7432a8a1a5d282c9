"""Stage `denoise_step`: one step = DiT on cond+uncond (one batch), guidance, UniPC update.

The scheduler is expressed as a coefficient row per step (runtime/scheduler.py), so
this one program serves any number of steps and any flow shift; the guidance scale
is an input too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .trace import Extracted


def build(ex: Extracted, order: int, dtype: Any) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """fn(weights, state, context, timestep, guidance, row) -> (new state, all-finite flag).

    state (order+2, B, C, T, H, W) float32, see runtime/scheduler.py for the layout;
    context (2B, L, D) float32: prompt embeddings then negative prompt embeddings;
    timestep int32 scalar; guidance float32 scalar; row float32 coefficients.
    """

    def step(weights: dict[str, Any], state: jax.Array, context: jax.Array, timestep: jax.Array,
             guidance: jax.Array, row: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, xprev, hist = state[0], state[1], state[2:]
        b = x.shape[0]
        model_in = jnp.concatenate([x, x]).astype(dtype)
        t = jnp.full((2 * b,), timestep, jnp.int32)
        out = ex.fn(weights, (model_in, t, context.astype(dtype)), {"return_dict": False})[0]
        cond, uncond = out[:b], out[b:]
        # As diffusers: uncond + g * (cond - uncond) in the model dtype, only when g > 1.
        guided = uncond + (guidance * (cond - uncond).astype(jnp.float32)).astype(out.dtype)
        v = jnp.where(guidance > 1.0, guided, cond).astype(jnp.float32)

        m_i = x - row[0] * v
        c = row[1:1 + order + 3]
        p = row[1 + order + 3:]
        xc = c[0] * x + c[1] * xprev + c[2] * m_i
        for j in range(order):
            xc = xc + c[3 + j] * hist[j]
        x_next = p[0] * xc + p[1] * m_i
        for j in range(order - 1):
            x_next = x_next + p[2 + j] * hist[j]
        new_state = jnp.stack([x_next, xc, m_i, *[hist[j] for j in range(order - 1)]])
        return new_state, jnp.all(jnp.isfinite(x_next))

    return step
