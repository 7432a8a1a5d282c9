"""A PyTorch reference of TAEHV's decoder, written from its architecture (../shared/DESIGN.md section 12), in the real
files' layout (`decoder.N.*` by nn.Sequential index, `encoder.N.*` beside it), at any width: the tests' stand-in for
taew2_1 / taew2_2 / taew2_2_super / lighttaew2_* files, which this machine cannot download.

`decode(model, latents)` is TAEHV's whole-clip ("parallel") decode: every layer over all time steps at once, each
MemBlock's past its input shifted one step (zeros first), then pixel shuffle, clamp and the first frames dropped.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


class Clamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2 * n, n, 3, padding=1), nn.ReLU(), nn.Conv2d(n, n, 3, padding=1),
                                  nn.ReLU(), nn.Conv2d(n, n, 3, padding=1))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, past], 1)) + x)


class SuperMemBlock(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2 * n, 2 * n, 7, padding=3, groups=2 * n, bias=False),
                                  nn.Conv2d(2 * n, 4 * n, 1), nn.ReLU(), nn.Conv2d(4 * n, n, 1, bias=False))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([x, past], 1)) + x


class TGrow(nn.Module):
    def __init__(self, n: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n, n * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nt, c, h, w = x.shape
        return self.conv(x).reshape(nt * self.stride, c, h, w)


def conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


def decoder(latent_channels: int, patch: int, widths: tuple[int, ...] = (256, 128, 64, 64), super_: bool = False,
            strides: tuple[int, int, int] = (1, 2, 2)) -> nn.Sequential:
    """TAEHV's decoder (base, or the super one) at these widths (the real ones are the default, and (512, 256, 128,
    64) for super)."""
    n = widths
    if super_:
        layers: list[nn.Module] = [nn.Conv2d(latent_channels, n[0], 1, bias=False)]
        for i in range(3):
            layers += [SuperMemBlock(n[i]), SuperMemBlock(n[i]), SuperMemBlock(n[i]), conv(n[i], n[i + 1] * 4),
                       nn.ReLU(), nn.PixelShuffle(2), TGrow(n[i + 1], strides[i])]
        layers.append(conv(n[3], 3 * patch * patch))
    else:
        layers = [Clamp(), conv(latent_channels, n[0]), nn.ReLU()]
        for i in range(3):
            layers += [MemBlock(n[i]), MemBlock(n[i]), MemBlock(n[i]), nn.Upsample(scale_factor=2),
                       TGrow(n[i], strides[i]), conv(n[i], n[i + 1], bias=False)]
        layers += [nn.ReLU(), conv(n[3], 3 * patch * patch)]
    return nn.Sequential(*layers)


def make_file(path: Path, latent_channels: int, patch: int, widths: tuple[int, ...], super_: bool = False,
              dtype: torch.dtype = torch.float16, seed: int = 0) -> nn.Sequential:
    """Random weights (scaled so activations stay in range) saved as a TAEHV file: decoder.* and a small encoder.*;
    returns the decoder, in float32, holding the weights as stored (rounded to `dtype`)."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    dec = decoder(latent_channels, patch, widths, super_)
    with torch.no_grad():
        for p in dec.parameters():
            scale = 0.05 if p.ndim == 1 else 1.0 / p[0].numel() ** 0.5  # biases small: frames not clamped flat
            p.copy_(torch.randn_like(p) * scale)
        dec[-1].bias.add_(0.5)  # mid-grey, so the clamp to [0, 1] cuts few pixels
        for p in dec.parameters():
            p.copy_(p.to(dtype).float())  # as stored
    tensors = {f"decoder.{k}": v.to(dtype).contiguous() for k, v in dec.state_dict().items()}
    tensors["encoder.0.weight"] = torch.randn(8, 3 * patch * patch, 3, 3).to(dtype)  # the half a decode leaves out
    tensors["encoder.0.bias"] = torch.zeros(8).to(dtype)
    save_file(tensors, str(path))
    return dec.float().eval()


@torch.no_grad()
def decode(dec: nn.Sequential, latents: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, T, Z, h, w) latents (TAEHV's NTCHW) -> (B, 4T - 3, 3, H, W) frames in [0, 1]."""
    b, t = latents.shape[:2]
    x = latents.reshape(b * t, *latents.shape[2:])
    for layer in dec:
        if isinstance(layer, (MemBlock, SuperMemBlock)):
            steps = x.shape[0] // b
            seq = x.reshape(b, steps, *x.shape[1:])
            past = F.pad(seq, (0, 0, 0, 0, 0, 0, 1, 0))[:, :steps].reshape(x.shape)
            x = layer(x, past)
        else:
            x = layer(x)
    if patch > 1:
        x = F.pixel_shuffle(x, patch)
    x = x.clamp(0, 1)
    steps = x.shape[0] // b
    scale = 1
    for layer in dec:
        if isinstance(layer, TGrow):
            scale *= layer.stride
    return x.reshape(b, steps, *x.shape[1:])[:, scale - 1:]
