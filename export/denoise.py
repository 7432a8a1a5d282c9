"""Stage `denoise_step`: one step = DiT on cond+uncond (one batch), guidance, UniPC update.

Variants (runtime/kinds.py DENOISE_VARIANTS) of the same step: `_cond` runs the cond half only,
for steps without guidance; `_residual` and `_cached` are MagCache's full and cached steps.

The scheduler is expressed as a coefficient row per step (runtime/scheduler.py), so
this one program serves any number of steps and any flow shift; the guidance scale
is an input too. A two-expert model runs this same program with the second
expert's weights (`denoise_step_2`); the host picks the expert per step. The
cross-attention keys and values of the prompt come in computed once per prompt
(export/cross_kv.py), not projected again in every block at every step.

What the DiT sees depends on the model kind's conditioning (runtime/kinds.py):
"concat" appends the mask and image latents on the channel axis ("video_concat", Lucy
Edit, the source video's latents); "first_frame" blends the image latent into the
masked frame and gives its tokens timestep 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.kinds import DENOISE_VARIANTS, DenoiseVariant, Kind

from . import attention, block_cache, cross_kv, face_motion
from .trace import Extracted


def build(ex: Extracted, order: int, dtype: Any, kind: Kind, text_tokens: int, patch: tuple[int, int] = (2, 2),
          variant: DenoiseVariant = DENOISE_VARIANTS["cfg"], history_sizes: tuple[int, ...] = (16, 2, 1)
          ) -> Callable[..., tuple[jax.Array, ...]]:
    """fn(weights, state, kv, timestep, guidance, row, *extras[, residual]) -> (new state, all-finite
    flag[, residual]).

    state (order+2, B, C, T, H, W) float32, see runtime/scheduler.py for the layout;
    kv in the model dtype (layers, 2, 2B, heads, S, head_dim): the cross-attention keys and values of the prompt then
    the negative prompt (export/cross_kv.py, S = image tokens + `text_tokens`); a `variant.cfg` program uses
    all 2B, one without the first B (and ignores `guidance`);
    timestep float32 scalar (what diffusers' scheduler gives the DiT: whole numbers for UniPC, sigma x 1000 for
    Euler); guidance float32 scalar; row float32 coefficients;
    extras, named by kind.conditioning_inputs: condition float32 ((B, 4 + z, T, H, W) for "concat",
    (B, z, T, H, W) for "video_concat", (B, z, 1, H, W) for "first_frame"), mask float32 (1, 1, T, H, W) (1 where
    the latents are denoised, 0 where the image stands);
    control float32 (B, C, T, H, W) and control_scale float32 (VACE layers,) for "vace": the VACE branch's
    input latents and the scale of each of its hints, as diffusers' control_hidden_states(_scale), the same for
    cond and uncond;
    condition float32 (B, 4 + z, T, H, W), pose float32 (B, z, T - 1, H, W) and motion float32 (2, B, T - 1, tokens,
    dim) for "animate": the reference and segment latents with their mask (as "concat"), the pose video's latents,
    and the face_motion program's vectors of the face video then (for the uncond half) of the black face;
    residual (2B, S, dim) in the model dtype: the transformer blocks' output minus input, returned by a
    "residual" variant and taken (instead of running the blocks) by a "cached" one (export/block_cache.py).

    "forcing" (SkyReels-V2 diffusion forcing) is `build_forcing`'s step, "helios" `build_helios`'s.
    """
    if kind.forcing:
        return build_forcing(ex, order, dtype, text_tokens, patch, variant)
    if kind.helios:
        return build_helios(ex, order, dtype, text_tokens, history_sizes, variant)
    if kind.flow_map:
        return build_flow_map(ex, order, dtype, text_tokens, variant)
    copies = 2 if variant.cfg else 1

    def step(weights: dict[str, Any], state: jax.Array, kv: jax.Array, timestep: jax.Array,
             guidance: jax.Array, row: jax.Array, *extras: jax.Array) -> tuple[jax.Array, ...]:
        residual = None
        if variant.residual == "in":
            *extras, residual = extras
        named = dict(zip(kind.conditioning_inputs, extras, strict=True))
        x = state[0]
        b = x.shape[0]
        if kind.channel_condition:  # as diffusers: cat([latents, condition], dim=1).to(dtype)
            model_x = jnp.concatenate([x, named["condition"]], axis=1)
            t = jnp.full((copies * b,), timestep, jnp.float32)
        elif kind.conditioning == "first_frame":  # (1 - mask) * condition + mask * latents; t per token
            mask = named["mask"]
            model_x = (1.0 - mask) * named["condition"] + mask * x
            tokens = (mask[0, 0][:, :: patch[0], :: patch[1]] * timestep).reshape(-1)
            t = jnp.broadcast_to(tokens, (copies * b, tokens.shape[0]))
        else:
            model_x = x
            t = jnp.full((copies * b,), timestep, jnp.float32)
        model_in = jnp.concatenate([model_x] * copies).astype(dtype)
        n = copies * b
        kv = kv[:, :, :n]  # already in the model dtype (cross_kv's output)
        # The text (and image) inputs are placeholders: the blocks take their keys and values from kv.
        kwargs: dict[str, Any] = {"return_dict": False}
        if kind.image_encoder:
            kwargs["encoder_hidden_states_image"] = jnp.zeros((n, 0, 0), dtype)
        if kind.vace:  # as diffusers: conditioning_latents.to(dtype), conditioning_scale.to(dtype)
            kwargs["control_hidden_states"] = jnp.concatenate([named["control"]] * copies).astype(dtype)
            kwargs["control_hidden_states_scale"] = named["control_scale"].astype(dtype)
        motion = contextlib.nullcontext()
        if kind.animate:  # the same pose for cond and uncond; the face's motion, and the black face's for uncond
            kwargs["pose_hidden_states"] = jnp.concatenate([named["pose"]] * copies).astype(dtype)
            kwargs["face_pixel_values"] = face_motion.placeholder(copies * b, dtype)
            faces = named["motion"][:copies]  # (copies, B, T - 1, tokens, dim): cond, then uncond
            motion = face_motion.precomputed(ex.module, ex.env, faces.reshape(-1, *faces.shape[2:]).astype(dtype))
        args = (model_in, t, jnp.zeros((n, text_tokens, 0), dtype))
        with cross_kv.precomputed(ex.module, ex.env, kv, text_tokens), motion:
            if variant.residual == "out":
                with block_cache.capture(ex.module) as box:
                    out = ex.fn(weights, args, kwargs)[0]
                residual = ex.env.t2j_iso(box["out"]) - ex.env.t2j_iso(box["in"])
            elif variant.residual == "in":  # no block runs, the VACE branch neither (its hints are in the residual)
                with block_cache.skip(ex.module, ex.env.j2t_iso(residual.astype(dtype))):
                    out = ex.fn(weights, args, kwargs)[0]
            else:
                out = ex.fn(weights, args, kwargs)[0]
        v = guided_velocity(out, b, guidance, variant.cfg)

        new_state = sampler_update(state, v, row, order)
        finite = jnp.all(jnp.isfinite(new_state[0]))
        if variant.residual == "out":
            return new_state, finite, residual
        return new_state, finite

    return step


def guided_velocity(out: jax.Array, b: int, guidance: jax.Array, cfg: bool) -> jax.Array:
    """The velocity a step takes, float32, from the DiT's output `out`: with `cfg`, its first `b` samples are the
    prompt's and the rest the negative prompt's, mixed as diffusers mixes them, uncond + g (cond - uncond) in the
    model dtype, only when g > 1 (else the cond half alone); without, the cond prediction alone."""
    if not cfg:
        return out.astype(jnp.float32)
    cond, uncond = out[:b], out[b:]
    guided = uncond + (guidance * (cond - uncond).astype(jnp.float32)).astype(out.dtype)
    return jnp.where(guidance > 1.0, guided, cond).astype(jnp.float32)


def sampler_update(state: jax.Array, v: jax.Array, row: jax.Array, order: int) -> jax.Array:
    """The sampler's step (runtime/scheduler.py's row layout) from the guided velocity `v`: the new state. `row` is one
    row (R,), or one per latent frame (T, R) (diffusion forcing: every frame steps its own schedule)."""
    x, xprev, hist = state[0], state[1], state[2:]

    def c(j: int) -> jax.Array:
        col = row[..., j]
        return col if col.ndim == 0 else col[None, None, :, None, None]  # against (B, C, T, H, W)

    m_i = x - c(0) * v
    xc = c(1) * x + c(2) * xprev + c(3) * m_i
    for j in range(order):
        xc = xc + c(4 + j) * hist[j]
    p = 1 + order + 3
    x_next = c(p) * xc + c(p + 1) * m_i
    for j in range(order - 1):
        x_next = x_next + c(p + 2 + j) * hist[j]
    return jnp.stack([x_next, xc, m_i, *[hist[j] for j in range(order - 1)]])


def build_forcing(ex: Extracted, order: int, dtype: Any, text_tokens: int, patch: tuple[int, int] = (2, 2),
                  variant: DenoiseVariant = DENOISE_VARIANTS["cfg"]) -> Callable[..., tuple[jax.Array, ...]]:
    """fn(weights, state, kv, timestep, guidance, row, noise, blend, update, causal_block, fps) -> (new state,
    all-finite flag): one step of SkyReels-V2 diffusion forcing (diffusers' SkyReelsV2DiffusionForcing*Pipeline's
    loop body), on the whole segment.

    state, kv, guidance as `build`'s (T latent frames); timestep float32 (T,): each latent frame's (999 for frames not
    started, 0 for pinned ones, addnoise_condition for re-noised ones); row float32 (T, R): each frame's own sampler
    row (the frame's k-th update takes row k); noise float32 (B, z, T, H, W) and blend float32 (T,): the DiT sees
    latents x (1 - blend) + noise x blend on the frames whose blend is not 0 (addnoise_condition / 1000, diffusers'
    torch.randn_like noise), the latents elsewhere; update float32 (T,): 1 where the frame's state steps, 0 where it
    is kept (frames not started, done, or pinned); causal_block int32: block-causal self-attention over frames in
    blocks of that many (<= 1: full attention; export/attention.py BlockCausal); fps int32: the frame rate the DiT's
    fps embedding is told (inject_sample_info models: 16 -> row 0, anything else row 1, as diffusers).
    """
    copies = 2 if variant.cfg else 1
    module = ex.module

    def step(weights: dict[str, Any], state: jax.Array, kv: jax.Array, timestep: jax.Array, guidance: jax.Array,
             row: jax.Array, noise: jax.Array, blend: jax.Array, update: jax.Array, causal_block: jax.Array,
             fps: jax.Array) -> tuple[jax.Array, ...]:
        x = state[0]
        b, _, frames, h, w = x.shape
        share = blend[None, None, :, None, None]
        # as diffusers: latents.to(dtype); the re-noised frames x (1 - a/1000) + randn x a/1000 in the model dtype
        xd = x.astype(dtype)
        renoised = ((xd.astype(jnp.float32) * (1.0 - share)).astype(dtype)
                    + (noise.astype(dtype).astype(jnp.float32) * share).astype(dtype))
        model_x = jnp.where(share > 0, renoised, xd)
        model_in = jnp.concatenate([model_x] * copies)
        n = copies * b
        t = jnp.broadcast_to(timestep.astype(jnp.float32), (n, frames))
        kwargs: dict[str, Any] = {"return_dict": False, "enable_diffusion_forcing": True, "fps": [0]}
        args = (model_in, t, jnp.zeros((n, text_tokens, 0), dtype))
        causal = attention.BlockCausal((h // patch[0]) * (w // patch[1]), causal_block)
        with cross_kv.precomputed(module, ex.env, kv[:, :, :n], text_tokens), fps_embedding(module, ex.env, fps), \
                attention.block_causal([blk.attn1 for blk in module.blocks], causal):
            out = ex.fn(weights, args, kwargs)[0]
        v = guided_velocity(out, b, guidance, variant.cfg)
        stepped = sampler_update(state, v, row, order)
        new_state = jnp.where(update[None, None, None, :, None, None] > 0, stepped, state)
        return new_state, jnp.all(jnp.isfinite(new_state[0]))

    return step


def helios_indices(history_sizes: tuple[int, ...], frames: int) -> dict[str, jax.Array]:
    """HeliosPipeline's frame indices (keep_first_frame): positions 0 (the first frame, the short history's prefix),
    then the long, mid and short history's frames, then the chunk's; the same for every chunk."""
    sizes = [1, *history_sizes, frames]
    ends = np.cumsum(sizes)
    idx = [np.arange(e - n, e) for n, e in zip(sizes, ends)]
    prefix, long, mid, one, hidden = idx
    as_batch = lambda a: jnp.asarray(a, jnp.int32)[None]  # noqa: E731 (B = 1: the same for every sample)
    return {"indices_hidden_states": as_batch(hidden), "indices_latents_history_short": as_batch(np.r_[prefix, one]),
            "indices_latents_history_mid": as_batch(mid), "indices_latents_history_long": as_batch(long)}


def build_helios(ex: Extracted, order: int, dtype: Any, text_tokens: int, history_sizes: tuple[int, ...],
                 variant: DenoiseVariant = DENOISE_VARIANTS["cfg"]) -> Callable[..., tuple[jax.Array, ...]]:
    """fn(weights, state, kv, timestep, guidance, row, history) -> (new state, all-finite flag): one step of a Helios
    chunk (diffusers' HeliosPipeline's loop body, its two CFG calls as one batch).

    state, kv, timestep, guidance, row as `build`'s (T: the chunk's latent frames; H, W: the pyramid stage's); history
    float32 (B, z, 1 + sum(history_sizes), H', W'): the clean latents the chunk sees at full resolution, [prefix (the
    first frame, or zeros), long, mid, short] (runtime/helios.py builds it), cast to the model dtype and split as
    diffusers splits them; its frame positions are fixed (helios_indices), so they are constants of the program;
    cfg_mode float32: 0 CFG, 1 CFG-Zero*, 2 a zero prediction (kinds.py "helios")."""
    copies = 2 if variant.cfg else 1
    n_long, n_mid, _ = history_sizes

    def step(weights: dict[str, Any], state: jax.Array, kv: jax.Array, timestep: jax.Array, guidance: jax.Array,
             row: jax.Array, history: jax.Array, cfg_mode: jax.Array) -> tuple[jax.Array, ...]:
        x = state[0]
        b, frames = x.shape[0], x.shape[2]
        hist = history.astype(dtype)
        long, mid = hist[:, :, 1:1 + n_long], hist[:, :, 1 + n_long:1 + n_long + n_mid]
        short = jnp.concatenate([hist[:, :, :1], hist[:, :, 1 + n_long + n_mid:]], axis=2)
        n = copies * b

        def both(a: jax.Array) -> jax.Array:
            return jnp.concatenate([a] * copies)

        kwargs: dict[str, Any] = {"return_dict": False, **helios_indices(tuple(history_sizes), frames),
                                  "latents_history_short": both(short), "latents_history_mid": both(mid),
                                  "latents_history_long": both(long)}
        t = jnp.full((n,), timestep, jnp.float32)
        args = (both(x).astype(dtype), t, jnp.zeros((n, text_tokens, 0), dtype))
        with cross_kv.precomputed(ex.module, ex.env, kv[:, :, :n], text_tokens):
            out = ex.fn(weights, args, kwargs)[0]
        if variant.cfg:  # as diffusers, when g > 1: noise_uncond + g * (noise_pred - noise_uncond), or CFG-Zero*
            cond, uncond = out[:b], out[b:]
            plain = uncond + (guidance * (cond - uncond).astype(jnp.float32)).astype(out.dtype)
            c32, u32 = cond.astype(jnp.float32), uncond.astype(jnp.float32)
            axes = tuple(range(1, cond.ndim))  # optimized_scale: per sample, over all of it
            alpha = (jnp.sum(c32 * u32, axis=axes, keepdims=True)
                     / (jnp.sum(u32 * u32, axis=axes, keepdims=True) + 1e-8)).astype(out.dtype)
            star = uncond * alpha + (guidance * (cond - uncond * alpha).astype(jnp.float32)).astype(out.dtype)
            guided = jnp.where(cfg_mode == 1, star, jnp.where(cfg_mode == 2, cond * 0, plain))
            v = jnp.where(guidance > 1.0, guided, cond).astype(jnp.float32)
        else:
            v = out.astype(jnp.float32)
        new_state = sampler_update(state, v, row, order)
        return new_state, jnp.all(jnp.isfinite(new_state[0]))

    return step


def build_flow_map(ex: Extracted, order: int, dtype: Any, text_tokens: int,
                   variant: DenoiseVariant = DENOISE_VARIANTS["cfg"]) -> Callable[..., tuple[jax.Array, ...]]:
    """fn(weights, state, kv, timestep, guidance, row, condition, mask, r_timestep) -> (new state, all-finite flag):
    one step of AnyFlow (diffusers' AnyFlowPipeline's loop body: its [neg, pos] batch as ours [pos, neg]).

    state, kv, timestep, guidance as `build`'s; row the flow map's (runtime/samplers.py "flowmap": m = x - (sigma_t -
    sigma_r) u is the new latents); condition float32 (B, z, T, H, W) and mask float32 (1, 1, T, H, W): the DiT sees
    the condition's frames where mask is 0 (a given video's first latent frames, whose timestep is 0), the latents
    where it is 1; r_timestep float32 (T,): each frame's target timestep. The transformer takes frames first (B, T,
    C, H, W) and a timestep per frame; its RoPE is complex128 in diffusers, here the same angles as real cos/sin
    (`real_rope`)."""
    copies = 2 if variant.cfg else 1

    def step(weights: dict[str, Any], state: jax.Array, kv: jax.Array, timestep: jax.Array, guidance: jax.Array,
             row: jax.Array, condition: jax.Array, mask: jax.Array, r_timestep: jax.Array) -> tuple[jax.Array, ...]:
        x = state[0]
        b, frames = x.shape[0], x.shape[2]
        model_x = (1.0 - mask) * condition + mask * x  # as diffusers' latent_model_input[:, :context] = video_latents
        model_in = jnp.swapaxes(jnp.concatenate([model_x] * copies).astype(dtype), 1, 2)
        n = copies * b
        t = jnp.broadcast_to(mask[0, 0, :, 0, 0] * timestep, (n, frames))
        r = jnp.broadcast_to(r_timestep, (n, frames))
        args = (model_in, t, r, jnp.zeros((n, text_tokens, 0), dtype))
        with cross_kv.precomputed(ex.module, ex.env, kv[:, :, :n], text_tokens), real_rope(ex.module, ex.env):
            out = jnp.swapaxes(ex.fn(weights, args, {"return_dict": False})[0], 1, 2)
        v = guided_velocity(out, b, guidance, variant.cfg)  # (diffusers' noise_uncond + g (noise_pred - uncond))
        new_state = sampler_update(state, v, row, order)
        return new_state, jnp.all(jnp.isfinite(new_state[0]))

    return step


def rope_angles(head_dim: int, frames: int, height: int, width: int, max_seq_len: int, theta: float = 10000.0
                ) -> np.ndarray:
    """AnyFlowRotaryPosEmbed's angles, float64 (frames x height x width tokens, head_dim / 2): per axis
    get_1d_rotary_pos_embed's outer(position, theta^(-2i/d)), over t, h, w channels of sizes d - 2(d//6)x2, 2(d//6),
    2(d//6) (halved: one angle per channel pair)."""
    hw = 2 * (head_dim // 6)
    tables = [np.outer(np.arange(max_seq_len, dtype=np.float64),
                       1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)) for d in (head_dim - 2 * hw, hw, hw)]
    grid = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    return np.concatenate([tab[pos.reshape(-1)] for tab, pos in zip(tables, grid)], axis=1)


@contextlib.contextmanager
def real_rope(module: Any, env: Any) -> Any:
    """While active, AnyFlow's RoPE is applied as real cos/sin of its float64 angles (float32, the rotation in
    float32), not as diffusers' complex128 product, which JAX without x64 cannot hold: the same rotation of each
    channel pair (x0 cos - x1 sin, x0 sin + x1 cos)."""
    import torch
    from diffusers.models.transformers import transformer_anyflow

    rope = module.rope

    def forward(layout_cfg: dict[str, Any], device: Any = None) -> dict[str, Any]:
        h, w = layout_cfg["full_frame_shape"]
        angles = rope_angles(rope.attention_head_dim, layout_cfg["total_frames"], h, w, rope.max_seq_len, rope.theta)
        cos, sin = (env.j2t_iso(jnp.asarray(f(angles)[None, None], jnp.float32)) for f in (np.cos, np.sin))
        return {"query": (cos, sin), "key": (cos, sin)}

    def rotate(hidden_states: Any, freqs: tuple[Any, Any]) -> Any:
        cos, sin = freqs
        x = hidden_states.float().unflatten(3, (-1, 2))
        x0, x1 = x[..., 0], x[..., 1]
        out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(3, 4)
        return out.type_as(hidden_states)

    saved = transformer_anyflow.apply_rotary_emb
    rope.forward = forward
    transformer_anyflow.apply_rotary_emb = rotate
    try:
        yield
    finally:
        transformer_anyflow.apply_rotary_emb = saved
        del rope.forward


@contextlib.contextmanager
def fps_embedding(module: Any, env: Any, fps: jax.Array) -> Any:
    """While active, the DiT's fps embedding (inject_sample_info) looks up the row of the traced frame rate `fps`
    (diffusers: 0 if fps == 16 else 1) instead of the placeholder the forward is given. No-op for other DiTs."""
    emb = getattr(module, "fps_embedding", None)
    if emb is None:
        yield
        return
    index = env.j2t_iso(jnp.where(fps == 16, 0, 1).astype(jnp.int32).reshape(1))
    handle = emb.register_forward_hook(lambda m, args, out: m.weight[index])
    try:
        yield
    finally:
        handle.remove()


def without(step: Callable[..., tuple[jax.Array, ...]], names: list[str], missing: dict[str, Any]
            ) -> Callable[..., tuple[jax.Array, ...]]:
    """`step` (taking the inputs `names` in order after the weights) without the inputs `missing` (name -> spec): zeros
    of their specs stand in, and nothing reads them (a block loop's head and tail run no block, so they take neither
    the cross-attention keys and values nor the causal block size)."""

    def fn(weights: dict[str, Any], *given: jax.Array) -> tuple[jax.Array, ...]:
        it = iter(given)
        full = [jnp.zeros(missing[n].shape, missing[n].dtype) if n in missing else next(it) for n in names]
        return step(weights, *full)

    return fn


def without_kv(step: Callable[..., tuple[jax.Array, ...]], kv: Any) -> Callable[..., tuple[jax.Array, ...]]:
    """`step` without its kv input, for what runs no transformer block (a block loop's head and tail, MagCache's
    cached step): zeros of kv's spec (shape, dtype) stand in, and nothing reads them."""

    def fn(weights: dict[str, Any], state: jax.Array, *rest: jax.Array) -> tuple[jax.Array, ...]:
        return step(weights, state, jnp.zeros(kv.shape, kv.dtype), *rest)

    return fn
