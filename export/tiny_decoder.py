"""Tiny video decoders (TAEHV's network: madebyollin's taew2_1 / taew2_2 / taew2_2_super, lightx2v's lighttaew2_*), read
from their .safetensors files and written in JAX, one latent frame per program call with the decoder's memory carried.

The file's layout is TAEHV's `nn.Sequential` indices (`decoder.N.*`; the encoder half, `encoder.N.*`, is not needed to
decode and is left out of the bundle). Two decoders exist, told apart by their tensors, never by the file's name:

    base  (taew2_1, taew2_2, lighttae*):  Clamp, conv3x3 Z->256, ReLU, then per stage n = 256, 128, 64:
          3 x MemBlock(n), nearest upsample x2, TGrow(n, s), conv3x3 n->next (no bias); ReLU, conv3x3 64->3p^2
    super (taew2_2_super):                conv1x1 Z->512, then per stage n = 512, 256, 128:
          3 x SuperMemBlock(n), conv3x3 n->next*r^2, ReLU, pixel shuffle r, TGrow(next, s); conv3x3 64->3p^2

then pixel shuffle p (p = 2 for the 48-channel Wan 2.2 latents) and a clamp to [0, 1]. A MemBlock sees its input and
its input one time step earlier (zeros before the first); TGrow(n, s) is a 1x1 convolution n -> s*n whose channel
block k becomes time step s*t + k. The widths, the time strides s, the latent channels Z and p are read from the
tensors. L latent frames give 4L raw frames, of which the first 3 are dropped: the first latent frame decodes to 1
frame, every later one to 4, as the Wan VAE's chunks do. Streaming one latent frame at a time with each MemBlock's last
input kept is the same computation as TAEHV's whole-clip ("parallel") mode, so memory does not grow with frames.

Latent conventions (`LATENTS`): "normalized" decoders (taew) take the Wan-normalised latents the DiT produces;
"raw" ones (lighttae, trained on LightX2V's `need_scaled` latents) take `z * std + mean` with the bundle's own VAE
statistics. Both give frames in [0, 1].
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.errors import UserError

LATENTS = ("normalized", "raw")
PREFIX = "decoder."

# The two decoders' nn.Sequential, one letter per index: c conv (weight, maybe bias), m MemBlock, s SuperMemBlock,
# g TGrow, and the parameterless K clamp, R ReLU, U nearest upsample x2, P pixel shuffle (its factor from the conv
# before it).
TEMPLATES = {"base": "KcR" + "mmmUgc" * 3 + "Rc", "super": "c" + "ssscRPg" * 3 + "c"}


@dataclass(frozen=True)
class Layer:
    kind: str  # a TEMPLATES letter
    index: int  # its decoder.N index
    stride: int = 1  # TGrow: time steps per input step; P: the shuffle factor
    channels: int = 0  # m, s, g: the width it works at


@dataclass(frozen=True)
class TinyDecoder:
    """What a tiny decoder file holds: its variant, layers and tensors (float32, `decoder.*` names)."""
    variant: str  # "base" | "super"
    latent_channels: int
    patch: int  # the final pixel shuffle
    layers: tuple[Layer, ...]
    tensors: dict[str, np.ndarray]

    @property
    def time_scale(self) -> int:
        return math.prod(layer.stride for layer in self.layers if layer.kind == "g")

    @property
    def spatial_scale(self) -> int:
        ups = [2 for layer in self.layers if layer.kind == "U"] + [layer.stride for layer in self.layers
                                                                    if layer.kind == "P"]
        return math.prod(ups) * self.patch

    def memory_shapes(self, batch: int, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """(B, C, H, W) of each MemBlock's kept input, in layer order, for latents of height x width."""
        out, h, w = [], height, width
        for layer in self.layers:
            if layer.kind in "ms":
                out.append((batch, layer.channels, h, w))
            elif layer.kind == "U":
                h, w = 2 * h, 2 * w
            elif layer.kind == "P":
                h, w = layer.stride * h, layer.stride * w
        return out


def default_latents(path: Path) -> str:
    """The convention a file's name implies when --tiny-decoder-latents is not given: lighttae's files take raw VAE
    latents, taew's normalised ones."""
    return "raw" if "lighttae" in path.name.lower() else "normalized"


def read(path: Path) -> TinyDecoder:
    """The decoder of the TAEHV-layout .safetensors file at `path`; UserError (one line) for anything else."""
    path = Path(path)
    if path.suffix.lower() in (".pth", ".pt", ".ckpt", ".bin"):
        raise UserError(f"--tiny-decoder {path}: a {path.suffix} file can run code when read, so it is never read "
                        "here: convert it to .safetensors (safetensors.torch.save_file), where you trust it")
    if not path.is_file():
        raise UserError(f"--tiny-decoder {path}: no such file")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            names = [k for k in f.keys() if k.startswith(PREFIX)]
            tensors = {k: np.asarray(f.get_tensor(k), np.float32) for k in names}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"--tiny-decoder {path}: not a readable .safetensors file ({e})") from None
    return parse(tensors, str(path))


def parse(tensors: dict[str, np.ndarray], what: str) -> TinyDecoder:
    """Recognise a decoder from its `decoder.*` tensors (shapes only decide)."""
    by_index: dict[int, dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"decoder\.(\d+)\.(.+)", name)
        if m:
            by_index.setdefault(int(m.group(1)), {})[m.group(2)] = t
    if not by_index:
        raise UserError(f"--tiny-decoder {what}: not a TAEHV-layout tiny decoder (no decoder.N.* tensors); expected "
                        "taew2_1, taew2_2, taew2_2_super or lighttaew2_* in .safetensors")
    variant = "super" if "weight" in by_index.get(0, {}) else "base"
    template = TEMPLATES[variant]
    layers: list[Layer] = []
    try:
        for i, kind in enumerate(template):
            p = _Tensors(by_index.get(i, {}), i)
            if kind in "KRUP":
                if p:
                    raise ValueError(f"decoder.{i} has tensors where {variant}'s has none")
                layers.append(Layer(kind, i))
            elif kind == "c":
                if p["weight"].ndim != 4 or set(p) - {"weight", "bias"}:
                    raise ValueError(f"decoder.{i} is not a convolution")
                layers.append(Layer(kind, i, channels=p["weight"].shape[0]))
            elif kind == "m":
                w0 = p["conv.0.weight"]
                if w0.shape[1] != 2 * w0.shape[0] or set(p) - {f"conv.{j}.{s}" for j in (0, 2, 4)
                                                                 for s in ("weight", "bias")} - {"skip.weight"}:
                    raise ValueError(f"decoder.{i} is not a MemBlock")
                layers.append(Layer(kind, i, channels=w0.shape[0]))
            elif kind == "s":
                w0 = p["conv.0.weight"]  # depthwise 7x7 over [x, past]
                if w0.shape[1] != 1 or {"conv.1.weight", "conv.3.weight"} - set(p):
                    raise ValueError(f"decoder.{i} is not a SuperMemBlock")
                layers.append(Layer(kind, i, channels=w0.shape[0] // 2))
            elif kind == "g":
                w = p["conv.weight"]
                if w.shape[0] % w.shape[1] or w.shape[2:] != (1, 1):
                    raise ValueError(f"decoder.{i} is not a TGrow")
                layers.append(Layer(kind, i, stride=w.shape[0] // w.shape[1], channels=w.shape[1]))
        extra = sorted(set(by_index) - set(range(len(template))))
        if extra:
            raise ValueError(f"decoder.{extra[0]} is past the {variant} decoder's {len(template)} layers")
        for j, layer in enumerate(layers):  # a pixel shuffle's factor: the conv before it over the TGrow after it
            if layer.kind == "P":
                out, width = layers[j - 2].channels, layers[j + 1].channels
                r = math.isqrt(out // width)
                if r * r * width != out:
                    raise ValueError(f"decoder.{layers[j - 2].index} gives {out} channels, not {width} x r^2")
                layers[j] = Layer("P", layer.index, stride=r)
        first = _Tensors(by_index.get(0 if variant == "super" else 1, {}), 0 if variant == "super" else 1)["weight"]
        last = layers[-1].channels
        patch = math.isqrt(last // 3)
        if patch * patch * 3 != last:
            raise ValueError(f"the last convolution gives {last} channels, not 3 x p^2")
    except (ValueError, IndexError) as e:
        detail = str(e)
        raise UserError(f"--tiny-decoder {what}: not a TAEHV-layout tiny decoder ({detail}); expected taew2_1, "
                        "taew2_2, taew2_2_super or lighttaew2_* in .safetensors") from None
    return TinyDecoder(variant=variant, latent_channels=int(first.shape[1]), patch=patch, layers=tuple(layers),
                       tensors={k: v for k, v in tensors.items() if re.fullmatch(r"decoder\.\d+\..+", k)})


class _Tensors(dict):
    """One layer's tensors by their name after decoder.N.: a missing one is a ValueError naming it."""

    def __init__(self, tensors: dict[str, np.ndarray], index: int) -> None:
        super().__init__(tensors)
        self.index = index

    def __missing__(self, key: str) -> np.ndarray:
        raise ValueError(f"decoder.{self.index}.{key} is missing")


# -- the network, channels last ----------------------------------------------------------------------------------------

def _conv(x: jax.Array, w: jax.Array, b: jax.Array | None = None, groups: int = 1) -> jax.Array:
    """torch's Conv2d (OIHW weight, 'same' padding k//2, stride 1) on (N, H, W, C)."""
    y = jax.lax.conv_general_dilated(x, jnp.transpose(w, (2, 3, 1, 0)), (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups,
                                     precision=jax.lax.Precision.HIGHEST)
    return y if b is None else y + b


def _shuffle(x: jax.Array, r: int) -> jax.Array:
    """torch's pixel_shuffle on (N, H, W, C*r*r): out[c, h*r+i, w*r+j] = in[c*r*r + i*r + j, h, w]."""
    if r == 1:
        return x
    n, h, w, c = x.shape
    x = x.reshape(n, h, w, c // (r * r), r, r)
    return jnp.transpose(x, (0, 1, 4, 2, 5, 3)).reshape(n, h * r, w * r, c // (r * r))


def build(dec: TinyDecoder, latents: str, latents_mean: Any, latents_std: Any, first: bool
          ) -> Callable[..., tuple[jax.Array, list[jax.Array]]]:
    """fn(weights, latents (B, Z, 1, h, w)[, *memory]) -> (frames (B, F, H, W, 3) in [0, 1], memory): one latent
    frame, F = 1 for the first (`first`: no memory in; 3 of its 4 frames are TAEHV's warm-up) and 4 after. Memory: each
    MemBlock's last input, (B, C, H, W) in layer order (`TinyDecoder.memory_shapes`)."""
    if latents not in LATENTS:
        raise ValueError(f"latents convention {latents!r} is not one of {LATENTS}")
    mean = np.asarray(latents_mean, np.float32).reshape(1, -1, 1, 1, 1)
    inv_std = 1.0 / np.asarray(latents_std, np.float32).reshape(1, -1, 1, 1, 1)
    n_mem = sum(layer.kind in "ms" for layer in dec.layers)

    def fn(weights: dict[str, jax.Array], z: jax.Array, *memory: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        def w(i: int, name: str) -> jax.Array | None:
            return weights.get(f"{PREFIX}{i}.{name}")

        if latents == "raw":  # what the VAE's decoder takes: diffusers' latents / (1 / std) + mean
            z = z / inv_std + mean
        x = jnp.transpose(z[:, :, 0], (0, 2, 3, 1))[:, None]  # (B, T=1, h, w, Z): time steps of this chunk
        old = [None] * n_mem if first else [jnp.transpose(m, (0, 2, 3, 1)) for m in memory]
        new: list[jax.Array] = []
        for layer in dec.layers:
            b, t, h, wd, c = x.shape
            flat = x.reshape(b * t, h, wd, c)
            i = layer.index
            if layer.kind == "K":
                x = jnp.tanh(x / 3) * 3
            elif layer.kind == "R":
                x = jax.nn.relu(x)
            elif layer.kind == "U":
                x = jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)
            elif layer.kind == "P":
                x = _shuffle(flat, layer.stride).reshape(b, t, h * layer.stride, wd * layer.stride, -1)
            elif layer.kind == "c":
                x = _conv(flat, w(i, "weight"), w(i, "bias")).reshape(b, t, h, wd, -1)
            elif layer.kind == "g":  # channel block k of step t -> step s*t + k
                y = _conv(flat, w(i, "conv.weight")).reshape(b, t, h, wd, layer.stride, c)
                x = jnp.moveaxis(y, 4, 2).reshape(b, t * layer.stride, h, wd, c)
            else:  # a MemBlock: each step with the step before it (this chunk's, or the memory's, or zeros)
                prev = old[len(new)]
                start = jnp.zeros_like(x[:, :1]) if prev is None else prev[:, None]
                past = jnp.concatenate([start, x[:, :-1]], axis=1).reshape(b * t, h, wd, c)
                new.append(x[:, -1])
                pair = jnp.concatenate([flat, past], axis=-1)
                if layer.kind == "m":
                    y = jax.nn.relu(_conv(pair, w(i, "conv.0.weight"), w(i, "conv.0.bias")))
                    y = jax.nn.relu(_conv(y, w(i, "conv.2.weight"), w(i, "conv.2.bias")))
                    y = _conv(y, w(i, "conv.4.weight"), w(i, "conv.4.bias"))
                    skip = flat if w(i, "skip.weight") is None else _conv(flat, w(i, "skip.weight"))
                    y = jax.nn.relu(y + skip)
                else:
                    y = _conv(pair, w(i, "conv.0.weight"), groups=2 * c)
                    y = jax.nn.relu(_conv(y, w(i, "conv.1.weight"), w(i, "conv.1.bias")))
                    y = _conv(y, w(i, "conv.3.weight")) + flat
                x = y.reshape(b, t, h, wd, -1)
        b, t, h, wd, c = x.shape
        frames = _shuffle(x.reshape(b * t, h, wd, c), dec.patch).reshape(b, t, h * dec.patch, wd * dec.patch, 3)
        frames = jnp.clip(frames, 0.0, 1.0)
        if first:
            frames = frames[:, dec.time_scale - 1:]  # TAEHV's warm-up frames
        return frames, [jnp.transpose(m, (0, 3, 1, 2)) for m in new]

    return fn
