"""Stage `face_motion`: Wan-Animate's face video as the motion vectors its face adapters attend to.

WanAnimateTransformer3DModel runs a motion encoder (StyleGAN-style convolutions, per face frame) and a face encoder
(causal convolutions over the frames) on the face video inside every DiT call, though they depend on the face video
alone: at the real size 3 TFLOP per 77-frame segment on a 242 MB input, for 1 MB of motion vectors. Here they run
once per segment (and once per request for the all-black face of the unconditional half), and the denoise programs
take the vectors (`precomputed`: the encoders return them instead, diffusers' forward does the rest).

The motion encoder runs its frames `motion_encoder_batch_size` at a time as diffusers does (each frame's vector is
its own, so the batches only bound the activations' memory), one traced batch after another, the last one shorter:
not a `lax.map`, as XLA's CPU backend runs convolutions inside a while loop about 9x slower than outside (2 frames:
22.8 s in a map, 2.6 s unrolled), and the encoder is small next to the frames it reads (37 convolutions a batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .trace import Extracted


def _motion(module: Any, frames: Any) -> Any:
    return module.motion_encoder(frames)


def _face(module: Any, vectors: Any) -> Any:
    return module.face_encoder(vectors)


def build(ex: Extracted, dtype: Any) -> Callable[..., jax.Array]:
    """fn(weights, face) -> motion: face float32 (1, 3, L, S, S) in [-1, 1] (S = motion_encoder_size); motion float32
    (1, T, tokens, dim), T = (L - 1) / 4 + 1 latent frames, what the face encoder gives (the DiT prepends a zero frame
    for its reference frame itself)."""
    batch = int(ex.module.config.motion_encoder_batch_size)

    def fn(weights: dict[str, Any], face: jax.Array) -> jax.Array:
        b, c, frames, s, _ = face.shape
        flat = jnp.transpose(face, (0, 2, 1, 3, 4)).reshape(b * frames, c, s, s).astype(dtype)
        vectors = jnp.concatenate([ex.fn(weights, (flat[i:i + batch],), {}, method=_motion)
                                   for i in range(0, flat.shape[0], batch)]).reshape(b, frames, -1)
        return ex.fn(weights, (vectors,), {}, method=_face).astype(jnp.float32)

    return fn


@contextlib.contextmanager
def precomputed(module: Any, env: Any, motion: jax.Array) -> Iterator[Any]:
    """While active, the DiT's motion and face encoders give `motion` (n, T, tokens, dim) whatever face video they
    are called with: the forward's face input is then a placeholder (`placeholder`), its encoders' work not traced."""
    value = env.j2t_iso(motion)
    module.motion_encoder.forward = lambda frames: frames.flatten(1)
    module.face_encoder.forward = lambda vectors: value
    try:
        yield
    finally:
        del module.motion_encoder.forward
        del module.face_encoder.forward


def placeholder(n: int, dtype: Any) -> jax.Array:
    """The face video argument while `precomputed`: one 1x1 frame per sample."""
    return jnp.zeros((n, 3, 1, 1, 1), dtype)
