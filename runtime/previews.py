"""Live previews of a denoising run, without the VAE: the current estimate of the denoised latents (x0) of one frame,
mapped to RGB by a fixed linear map per latent family.

The estimate costs nothing to get: after step i the step programs' state holds m_i = x_i - sigma_i v_i, the converted
model output (runtime/scheduler.py, state row 2), which is the flow model's prediction of the clean latents. A preview
takes one latent frame of it (the one that decodes to the video's middle frame), projects its channels to RGB with a
3 x C matrix and a bias on the device, and copies the small (h, w, 3) result to the host: a few hundred kilobytes for
a 720p latent frame, against a step that reads the whole DiT.

The factors are ComfyUI's latent-to-RGB approximations (Comfy-Org/ComfyUI, `comfy/latent_formats.py`, classes `Wan21`
(16 channels: the Wan 2.1 VAE, which Wan 2.2's A14B models share) and `Wan22` (48 channels: the Wan 2.2 TI2V VAE));
published constants, fitted by their authors as a least-squares map from normalised latents to pixels in [-1, 1],
applied there too to the model's denoised estimate in the normalised latent space the sampler works in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .manifest import Geometry


@dataclass(frozen=True)
class LatentFamily:
    name: str
    factors: tuple[tuple[float, float, float], ...]  # one (R, G, B) row per latent channel
    bias: tuple[float, float, float]

    @property
    def channels(self) -> int:
        return len(self.factors)


WAN21 = LatentFamily("wan2.1", (
    (-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747), (0.0372, 0.2344, 0.1420),
    (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665), (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975),
    (-0.0412, 0.0267, -0.1364), (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
    (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950), (0.1984, 0.0913, 0.1861),
), (-0.1835, -0.0868, -0.3360))

WAN22 = LatentFamily("wan2.2", (
    (0.0119, 0.0103, 0.0046), (-0.1062, -0.0504, 0.0165), (0.0140, 0.0409, 0.0491), (-0.0813, -0.0677, 0.0607),
    (0.0656, 0.0851, 0.0808), (0.0264, 0.0463, 0.0912), (0.0295, 0.0326, 0.0590), (-0.0244, -0.0270, 0.0025),
    (0.0443, -0.0102, 0.0288), (-0.0465, -0.0090, -0.0205), (0.0359, 0.0236, 0.0082), (-0.0776, 0.0854, 0.1048),
    (0.0564, 0.0264, 0.0561), (0.0006, 0.0594, 0.0418), (-0.0319, -0.0542, -0.0637), (-0.0268, 0.0024, 0.0260),
    (0.0539, 0.0265, 0.0358), (-0.0359, -0.0312, -0.0287), (-0.0285, -0.1032, -0.1237), (0.1041, 0.0537, 0.0622),
    (-0.0086, -0.0374, -0.0051), (0.0390, 0.0670, 0.2863), (0.0069, 0.0144, 0.0082), (0.0006, -0.0167, 0.0079),
    (0.0313, -0.0574, -0.0232), (-0.1454, -0.0902, -0.0481), (0.0714, 0.0827, 0.0447), (-0.0304, -0.0574, -0.0196),
    (0.0401, 0.0384, 0.0204), (-0.0758, -0.0297, -0.0014), (0.0568, 0.1307, 0.1372), (-0.0055, -0.0310, -0.0380),
    (0.0239, -0.0305, 0.0325), (-0.0663, -0.0673, -0.0140), (-0.0416, -0.0047, -0.0023), (0.0166, 0.0112, -0.0093),
    (-0.0211, 0.0011, 0.0331), (0.1833, 0.1466, 0.2250), (-0.0368, 0.0370, 0.0295), (-0.3441, -0.3543, -0.2008),
    (-0.0479, -0.0489, -0.0420), (-0.0660, -0.0153, 0.0800), (-0.0101, 0.0068, 0.0156), (-0.0690, -0.0452, -0.0927),
    (-0.0145, 0.0041, 0.0015), (0.0421, 0.0451, 0.0373), (0.0504, -0.0483, -0.0356), (-0.0837, 0.0168, 0.0055),
), (0.0317, -0.0878, -0.1388))

FAMILIES = {f.channels: f for f in (WAN21, WAN22)}  # the VAE's latent channels name its family
X0_ROW = 2  # the state row that holds the latest converted model output after a step (runtime/scheduler.py)


def family(channels: int) -> LatentFamily | None:
    """The latent family of a VAE with this many latent channels (16: Wan 2.1, 48: Wan 2.2), or None: no preview."""
    return FAMILIES.get(int(channels))


def middle_frame(g: Geometry) -> int:
    """The index on the latents' frame axis (reference frames first: VACE, Animate) of the latent frame that decodes to
    the video's middle frame ((frames - 1) // 2): latent frame 0 decodes to frame 0, latent frame t > 0 to frames
    temporal_scale x (t - 1) + 1 .. temporal_scale x t."""
    f = (g.frames - 1) // 2
    return g.reference_images + (0 if f == 0 else (f - 1) // g.temporal_scale + 1)


def latent_rgb(frame: np.ndarray, fam: LatentFamily) -> np.ndarray:
    """One latent frame (C, h, w) in the sampler's normalised space -> uint8 RGB (h, w, 3), on the host: the reference
    the device projection (`Previewer`) is tested against."""
    rgb = np.einsum("chw,cr->hwr", np.asarray(frame, np.float32), np.asarray(fam.factors, np.float32))
    return to_uint8(rgb + np.asarray(fam.bias, np.float32))


def to_uint8(rgb: np.ndarray) -> np.ndarray:
    """[-1, 1] -> uint8 (as ComfyUI's preview_to_image: (x + 1) / 2, clamped, x 255, truncated)."""
    return (np.clip((np.asarray(rgb, np.float32) + 1.0) / 2.0, 0.0, 1.0) * 255).astype(np.uint8)


class Previewer:
    """The preview of a run of shape `g`: `previewer(state)` takes the step programs' state (on the devices, any
    sharding) after a step and returns the uint8 (h, w, 3) RGB estimate of the video's middle frame (batch item 0).
    One small jitted program (a slice and a 3 x C projection), compiled on first use; on a multi-process slice every
    process must call it (it reads a global array), as every process runs the same steps."""

    def __init__(self, g: Geometry) -> None:
        fam = family(g.latent_channels)
        if fam is None:
            raise ValueError(f"no latent-to-RGB factors for {g.latent_channels}-channel latents (only "
                             f"{', '.join(map(str, FAMILIES))})")
        self.family, self.frame = fam, middle_frame(g)
        self.size = (g.width, g.height)
        self._fn = _projection(fam, self.frame)

    def __call__(self, state: Any) -> np.ndarray:
        from .distributed import fetch

        return to_uint8(fetch(self._fn(state)))


class TinyPreviewer:
    """The preview through the bundle's tiny decoder (export --tiny-decoder): x0's latent frame that decodes to the
    middle of the video (all batch items, on the devices), decoded alone by the decoder's first-chunk program into one
    frame at the video's size; batch item 0's, as uint8. A real frame, where the linear map only approximates colours,
    for the cost of one chunk of the tiny decoder per step (BENCHMARKS.md)."""

    def __init__(self, g: Geometry, decode_first: Callable[..., Any]) -> None:
        self.frame, self.size = middle_frame(g), (g.width, g.height)
        self._decode = decode_first
        self._slice = _x0_frame(self.frame)

    def __call__(self, state: Any) -> np.ndarray:
        from .distributed import fetch

        frames, _ = self._decode(fetch(self._slice(state)))
        return (np.clip(fetch(frames)[0, 0].astype(np.float32), 0.0, 1.0) * 255).astype(np.uint8)


@functools.lru_cache(maxsize=16)
def _x0_frame(t: int) -> Callable[[Any], Any]:
    import jax
    import jax.numpy as jnp

    @jax.jit
    def take(state: Any) -> Any:
        return state[X0_ROW, :, :, t:t + 1].astype(jnp.float32)  # (B, C, 1, h, w)

    return take


@functools.lru_cache(maxsize=16)
def _projection(fam: LatentFamily, t: int) -> Callable[[Any], Any]:
    import jax
    import jax.numpy as jnp

    factors = np.asarray(fam.factors, np.float32)
    bias = np.asarray(fam.bias, np.float32)

    @jax.jit
    def project(state: Any) -> Any:
        x0 = state[X0_ROW, 0, :, t].astype(jnp.float32)  # (C, h, w)
        return jnp.einsum("chw,cr->hwr", x0, factors) + bias

    return project


def upscale(rgb: np.ndarray, width: int, height: int) -> Any:
    """The latent-resolution preview as a PIL image at the video's size (bilinear)."""
    from PIL import Image

    image = Image.fromarray(np.asarray(rgb, np.uint8))
    return image if image.size == (width, height) else image.resize((width, height), Image.BILINEAR)
