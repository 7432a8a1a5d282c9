"""Stage `denoise_step`: one step = DiT on cond+uncond (one batch), guidance, UniPC update.

The scheduler is expressed as a coefficient row per step (runtime/scheduler.py), so
this one program serves any number of steps and any flow shift; the guidance scale
is an input too. A two-expert model runs this same program with the second
expert's weights (`denoise_step_2`); the host picks the expert per step.

What the DiT sees depends on the model kind's conditioning (runtime/kinds.py):
"concat" appends the mask and image latents on the channel axis; "first_frame"
blends the image latent into the masked frame and gives its tokens timestep 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from runtime.kinds import Kind

from .trace import Extracted


def build(ex: Extracted, order: int, dtype: Any, kind: Kind, patch: tuple[int, int] = (2, 2)
          ) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """fn(weights, state, context, timestep, guidance, row, *extras) -> (new state, all-finite flag).

    state (order+2, B, C, T, H, W) float32, see runtime/scheduler.py for the layout;
    context (2B, L, D) float32: prompt embeddings then negative prompt embeddings;
    timestep int32 scalar; guidance float32 scalar; row float32 coefficients;
    extras, named by kind.denoise_extras: condition float32 ((B, 4 + z, T, H, W) for "concat",
    (B, z, 1, H, W) for "first_frame"), mask float32 (1, 1, T, H, W) (1 where the latents are
    denoised, 0 where the image stands), image_embeds float32 (B x images, tokens, D_img).
    """

    def step(weights: dict[str, Any], state: jax.Array, context: jax.Array, timestep: jax.Array,
             guidance: jax.Array, row: jax.Array, *extras: jax.Array) -> tuple[jax.Array, jax.Array]:
        named = dict(zip(kind.denoise_extras, extras, strict=True))
        x, xprev, hist = state[0], state[1], state[2:]
        b = x.shape[0]
        if kind.conditioning == "concat":  # as diffusers: cat([latents, condition], dim=1).to(dtype)
            model_x = jnp.concatenate([x, named["condition"]], axis=1)
            t = jnp.full((2 * b,), timestep, jnp.int32)
        elif kind.conditioning == "first_frame":  # (1 - mask) * condition + mask * latents; t per token
            mask = named["mask"]
            model_x = (1.0 - mask) * named["condition"] + mask * x
            tokens = (mask[0, 0][:, :: patch[0], :: patch[1]] * timestep.astype(jnp.float32)).reshape(-1)
            t = jnp.broadcast_to(tokens, (2 * b, tokens.shape[0]))
        else:
            model_x = x
            t = jnp.full((2 * b,), timestep, jnp.int32)
        model_in = jnp.concatenate([model_x, model_x]).astype(dtype)
        kwargs: dict[str, Any] = {"return_dict": False}
        if "image_embeds" in named:  # the same image for cond and uncond
            image = named["image_embeds"]
            kwargs["encoder_hidden_states_image"] = jnp.concatenate([image, image]).astype(dtype)
        out = ex.fn(weights, (model_in, t, context.astype(dtype)), kwargs)[0]
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
