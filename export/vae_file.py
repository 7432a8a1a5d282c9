"""`--vae FILE`: a Wan 2.1 VAE from one .safetensors file in the original Wan layout, in place of the checkpoint's.

lightx2v ships LightVAE (`lightvaew2_1.safetensors`: the Wan 2.1 VAE with every width x0.25, 8.0 M parameters
instead of 126.9 M, its convolutions about 1/16 the FLOPs) and Wan/ComfyUI ship the full VAE under the original
names (`encoder.downsamples.N.residual.2.weight`, `decoder.upsamples.N...`, `conv1`, `conv2`), not diffusers'.
The architecture is diffusers' `AutoencoderKLWan` at other widths, so the file's config is read from its
tensor shapes (base_dim, z_dim, dim_mult, num_res_blocks, temperal_downsample) and its names are renamed to
diffusers' (a pure rename: diffusers' `convert_wan_vae_to_diffusers` does the same for the 2.1 sizes; this
one follows the layout's own structure, so any width, stage count or res-block count maps). Everything the
file cannot say (latents_mean/latents_std, the scale factors) stays the checkpoint's: the latent space must
be the checkpoint's, which is checked (z_dim, spatial and temporal scale) before anything is built.

Only safetensors are read: a .pth/.pt/.ckpt file can run code when read, so it is refused with how to convert it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import UserError

FLAG = "--vae"
PICKLES = (".pth", ".pt", ".ckpt", ".bin", ".pkl")
_FLOATS = ("F32", "F16", "BF16")

# Block-local names: the original ResidualBlock's Sequential (RMS_norm, SiLU, conv, RMS_norm, SiLU, Dropout, conv)
# and 1x1x1 shortcut -> diffusers' WanResidualBlock; Resample and AttentionBlock keep their names.
_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
             "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
             "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_RESAMPLE = {k: k for k in ("resample.1.weight", "resample.1.bias", "time_conv.weight", "time_conv.bias")}
_ATTENTION = {k: k for k in ("norm.gamma", "to_qkv.weight", "to_qkv.bias", "proj.weight", "proj.bias")}
_FIXED = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
          "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias"}
for _part in ("encoder", "decoder"):
    _FIXED.update({f"{_part}.conv1.{p}": f"{_part}.conv_in.{p}" for p in ("weight", "bias")})
    _FIXED.update({f"{_part}.head.0.gamma": f"{_part}.norm_out.gamma",
                   **{f"{_part}.head.2.{p}": f"{_part}.conv_out.{p}" for p in ("weight", "bias")}})
    for _i, _block in ((0, "resnets.0"), (2, "resnets.1")):
        _FIXED.update({f"{_part}.middle.{_i}.{k}": f"{_part}.mid_block.{_block}.{v}" for k, v in _RESIDUAL.items()})
    _FIXED.update({f"{_part}.middle.1.{k}": f"{_part}.mid_block.attentions.0.{v}" for k, v in _ATTENTION.items()})

# keys that say which other layout a file is in, for an error that says what it is
_DIFFUSERS = re.compile(r"^(encoder\.conv_in|decoder\.up_blocks|encoder\.down_blocks|quant_conv|post_quant_conv)\.")
_TAEHV = re.compile(r"^(encoder|decoder)\.\d+\.")
_BLOCK = re.compile(r"^(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class VaeFile:
    """A checked VAE file: its diffusers config (over the checkpoint's) and where each diffusers tensor is."""

    path: Path
    sha256: str
    config: dict[str, Any]  # AutoencoderKLWan's config: the file's architecture, the checkpoint's latent space
    names: dict[str, str]  # diffusers name -> the file's name

    def describe(self) -> dict[str, str]:
        """What the manifest's `source` records, so a bundle with another VAE has another bundle id."""
        return {"file": self.path.name, "sha256": self.sha256}

    def tensors(self) -> dict[str, Any]:
        """The weights under diffusers' names, in float32 (diffusers runs the Wan VAE in float32; so do we)."""
        import torch
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            return {new: f.get_tensor(old).to(torch.float32) for new, old in self.names.items()}


def read(path: Path, model_vae: dict[str, Any]) -> VaeFile:
    """Check `path` from its header alone (no tensor is read) and against `model_vae`, the checkpoint's VAE config:
    a Wan 2.1 VAE in the original layout whose latent space is the checkpoint's. UserError (one line) otherwise."""
    from runtime.manifest import sha256_file

    path = Path(path)
    shapes = _header(path)
    config = {**model_vae, **infer_config(shapes, path)}
    _check_latent_space(config, model_vae, path)
    names = diffusers_names(list(shapes), config["num_res_blocks"], path)
    _check_architecture({new: shapes[old] for new, old in names.items()}, config, path)
    return VaeFile(path=path, sha256=sha256_file(path), config=config, names=names)


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor, from the safetensors header; refuses pickles, other files and non-float
    tensors."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise UserError(f"{FLAG} {path} does not exist")
    if path.suffix.lower() in PICKLES:
        raise UserError(f"{FLAG} {path} is a pickle checkpoint, which wan-aot never loads (unpickling can run code): "
                        "convert it to .safetensors where you trust it (safetensors.torch.save_file(torch.load(FILE, "
                        "weights_only=True), 'vae.safetensors')) and pass that")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {FLAG} {path} as safetensors ({e}): give a .safetensors file") from None
    for name, (dtype, _) in header.items():
        if dtype not in _FLOATS:
            raise UserError(f"{FLAG} {path}: tensor {name} is {dtype}; a VAE file holds float32, float16 or bfloat16 "
                            "weights")
    return {k: shape for k, (_, shape) in header.items()}


def _layout_error(path: Path, shapes: dict[str, tuple[int, ...]], missing: str) -> UserError:
    """The one line for a file that is not a Wan 2.1 VAE in the original layout, saying what it looks like."""
    keys = list(shapes)
    what = "the original Wan 2.1 VAE layout (as Wan2.1_VAE and lightx2v's lightvaew2_1 ship it)"
    if any(_DIFFUSERS.match(k) for k in keys):
        return UserError(f"{FLAG} {path} is a VAE in diffusers' layout (encoder.conv_in, decoder.up_blocks, ...); "
                         f"{FLAG} takes {what}: put a diffusers VAE in the checkpoint's vae/ folder instead")
    if any(_TAEHV.match(k) for k in keys):
        return UserError(f"{FLAG} {path} looks like a TAEHV tiny autoencoder (encoder.N.* / decoder.N.* keys), not a "
                         f"Wan VAE; {FLAG} takes {what}: pass a tiny decoder with --tiny-decoder")
    return UserError(f"{FLAG} {path} is not a Wan 2.1 VAE in {what} ({missing}); a Wan 2.2 VAE or another "
                     "model's VAE cannot replace a Wan 2.1 one")


def infer_config(shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, Any]:
    """AutoencoderKLWan's architecture arguments from the original layout's tensor shapes.

    Encoder: conv1 gives base_dim; `downsamples` is num_res_blocks residual blocks per stage, a Resample between
    stages (with a `time_conv` where the stage also halves time); a stage's width is its last residual block's
    output. z_dim is conv2's (the 1x1x1 conv before the decoder). The decoder's width is read on its own
    (decoder_base_dim, None where it is base_dim)."""
    for need in ("encoder.conv1.weight", "conv2.weight", "decoder.conv1.weight"):
        if need not in shapes:
            raise _layout_error(path, shapes, f"no {need}")
    blocks: dict[int, set[str]] = {}
    for key in shapes:
        m = _BLOCK.match(key)
        if m and m.group(1) == "encoder.downsamples":
            blocks.setdefault(int(m.group(2)), set()).add(m.group(3))
    if sorted(blocks) != list(range(len(blocks))) or not blocks:
        raise _layout_error(path, shapes, "encoder.downsamples is not numbered 0, 1, 2, ...")
    stages: list[list[int]] = [[]]
    resamples: list[int] = []
    for i in range(len(blocks)):
        if "resample.1.weight" in blocks[i]:
            resamples.append(i)
            stages.append([])
        elif "residual.2.weight" in blocks[i]:
            stages[-1].append(i)
        else:
            raise _layout_error(path, shapes, f"encoder.downsamples.{i} is neither a residual block nor a resample")
    num_res_blocks = len(stages[0])
    if num_res_blocks == 0 or any(len(s) != num_res_blocks for s in stages):
        raise _layout_error(path, shapes, "its encoder stages have different numbers of residual blocks")
    base_dim = shapes["encoder.conv1.weight"][0]
    widths = [shapes[f"encoder.downsamples.{s[-1]}.residual.6.weight"][0] for s in stages]
    if any(w % base_dim for w in widths):
        raise _layout_error(path, shapes, f"stage widths {widths} are not multiples of encoder.conv1's {base_dim}")
    dim_mult = [w // base_dim for w in widths]
    decoder_width = shapes["decoder.conv1.weight"][0]
    if decoder_width % dim_mult[-1]:
        raise _layout_error(path, shapes, f"decoder.conv1's width {decoder_width} is not a multiple of "
                                          f"{dim_mult[-1]}")
    decoder_base_dim = decoder_width // dim_mult[-1]
    return {"base_dim": base_dim, "decoder_base_dim": None if decoder_base_dim == base_dim else decoder_base_dim,
            "z_dim": shapes["conv2.weight"][0], "dim_mult": dim_mult, "num_res_blocks": num_res_blocks,
            "attn_scales": [], "temperal_downsample": [f"encoder.downsamples.{i}.time_conv.weight" in shapes
                                                       for i in resamples],
            "is_residual": False, "in_channels": 3, "out_channels": 3, "patch_size": None}


def _check_latent_space(config: dict[str, Any], model_vae: dict[str, Any], path: Path) -> None:
    """The DiT's latents must mean the same to the file's VAE: the channel count and the spatial and temporal scales
    the checkpoint's VAE has (its latents_mean/latents_std are kept)."""
    if model_vae.get("is_residual") or model_vae.get("patch_size"):
        raise UserError(f"{FLAG} {path} is a Wan 2.1 VAE, but this model uses the Wan 2.2 VAE (a 48-channel, 16x "
                        f"latent space): {FLAG} replaces only a Wan 2.1 VAE (Wan 2.1 models, Wan 2.2 A14B)")
    model_z = int(model_vae.get("z_dim") or 16)
    if config["z_dim"] != model_z:
        raise UserError(f"{FLAG} {path} has z_dim {config['z_dim']} but the model's latents have {model_z} channels: "
                        "give a VAE of the model's latent space (a Wan 2.1 VAE has z_dim 16)")
    spatial = 2 ** (len(config["dim_mult"]) - 1)
    temporal = 2 ** sum(bool(t) for t in config["temperal_downsample"])
    want = (int(model_vae.get("scale_factor_spatial") or 8), int(model_vae.get("scale_factor_temporal") or 4))
    if (spatial, temporal) != want:
        raise UserError(f"{FLAG} {path} scales {spatial}x in space and {temporal}x in time but the model's VAE "
                        f"{want[0]}x and {want[1]}x: give a VAE of the model's latent space")


def diffusers_names(keys: list[str], num_res_blocks: int, path: Path = Path("?")) -> dict[str, str]:
    """diffusers name -> original name for every key of a Wan 2.1 VAE in the original layout.

    The encoder's `downsamples` list is diffusers' `down_blocks` index for index; the decoder's flat `upsamples`
    (num_res_blocks + 1 residual blocks, then a Resample, per stage) become `up_blocks.S.resnets.J` and
    `up_blocks.S.upsamplers.0`."""
    per_stage = num_res_blocks + 2
    out: dict[str, str] = {}
    for key in keys:
        new = _FIXED.get(key)
        m = _BLOCK.match(key)
        if new is None and m:
            index, rest = int(m.group(2)), m.group(3)
            if m.group(1) == "encoder.downsamples":
                local = _RESIDUAL.get(rest) or _RESAMPLE.get(rest)
                new = f"encoder.down_blocks.{index}.{local}" if local else None
            elif index % per_stage <= num_res_blocks:
                local = _RESIDUAL.get(rest)
                new = f"decoder.up_blocks.{index // per_stage}.resnets.{index % per_stage}.{local}" if local else None
            else:
                local = _RESAMPLE.get(rest)
                new = f"decoder.up_blocks.{index // per_stage}.upsamplers.0.{local}" if local else None
        if new is None:
            raise _layout_error(path, dict.fromkeys(keys, ()), f"unexpected tensor {key}")
        out[new] = key
    return out


def _check_architecture(shapes: dict[str, tuple[int, ...]], config: dict[str, Any], path: Path) -> None:
    """Every tensor of AutoencoderKLWan(**config), at its shape, and nothing else (the model built on `meta`)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan

    args = {k: v for k, v in config.items() if not k.startswith("_")}
    with init_empty_weights():
        want = {k: tuple(t.shape) for k, t in AutoencoderKLWan(**args).state_dict().items()}
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    if extra:
        raise _layout_error(path, shapes, f"tensor {extra[0]} (diffusers' name) is not part of the architecture its "
                                          f"shapes give")
    if missing:
        raise _layout_error(path, shapes, f"no tensor for diffusers' {missing[0]}"
                                          f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
    for name in sorted(want):
        if shapes[name] != want[name]:
            raise _layout_error(path, shapes, f"{name} is {list(shapes[name])} where its config "
                                              f"(base_dim {config['base_dim']}, dim_mult {config['dim_mult']}) "
                                              f"gives {list(want[name])}")
