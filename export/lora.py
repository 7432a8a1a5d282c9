"""`python -m export --lora SOURCE --bundle BUNDLE --out ADAPTER.safetensors`: a Wan LoRA as a bundle adapter.

The source may be in any format diffusers' Wan LoRA loader reads (diffusers/PEFT keys, the original
Wan / ComfyUI `diffusion_model.` keys, musubi's `lora_unet_` keys): `WanLoraLoaderMixin.lora_state_dict`
converts it to diffusers' keys (folding the original formats' alphas in), and the PEFT scale of each
module (lora_alpha / r, with the file's rank and alpha patterns; alpha = r where the file says nothing)
is folded into B here. The adapter is keyed by the bundle's tensor names:

    <group>.<tensor>.lora_A   (r, in)  float32
    <group>.<tensor>.lora_B   (out, r) float32, scale folded in
    <group>.<bias>.delta      (out,)   float32, a LoRA bias (diffusers' lora_B.bias, the `diff_b` keys)

with `group` the expert (`transformer`, `transformer_2`) and a header naming the bundle it was made
for (runtime/lora.py reads it, and merges W + scale x B @ A per device shard when the weights are
placed). Reading the source never unpickles: only safetensors files are accepted.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from runtime import manifest as mf
from runtime.errors import UserError
from runtime.files import atomic_path
from runtime.lora import FORMAT, GROUPS

log = logging.getLogger("export")


def lora_file(source: Path) -> Path:
    """The LoRA's .safetensors file: `source` itself, or the one LoRA file of a directory."""
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        preferred = [f for f in files if f.name == "pytorch_lora_weights.safetensors"]
        if len(preferred or files) != 1:
            raise UserError(f"{path} holds {len(files)} .safetensors files: pass the LoRA file itself")
        path = (preferred or files)[0]
    if not path.is_file():
        raise UserError(f"LoRA {source} does not exist (a .safetensors file, or a directory holding one)")
    if path.suffix != ".safetensors":
        raise UserError(f"LoRA {path} is not a .safetensors file: convert it to safetensors first (pickled "
                        "checkpoints are never loaded)")
    return path


def to_diffusers(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """diffusers' own reading and conversion of a Wan LoRA in any format it knows: its `transformer.` PEFT
    keys, and its adapter metadata (LoraConfig fields, keys prefixed by the component; {} if the file has none)."""
    from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin

    try:  # use_safetensors=True: diffusers reads the .safetensors file only, no other format
        state, metadata = WanLoraLoaderMixin.lora_state_dict(str(path.parent), weight_name=path.name,
                                                             use_safetensors=True, local_files_only=True,
                                                             return_lora_metadata=True)
    except Exception as e:  # noqa: BLE001  (diffusers raises many kinds on a foreign file)
        raise UserError(f"diffusers cannot read {path} as a Wan LoRA ({type(e).__name__}: {e})") from None
    return state, metadata or {}


def _pattern(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rank/alpha pattern lookup: a key matches a module name that ends with it at a dot boundary."""
    for key, value in patterns.items():
        if module == key or re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def module_scales(modules: dict[str, int], metadata: dict[str, Any] | None) -> dict[str, float]:
    """The PEFT scaling of each LoRA module (name -> its rank): what diffusers' loader would configure.

    With the file's adapter metadata (a LoraConfig), lora_alpha / r with its patterns (rsLoRA: / sqrt(r));
    without, diffusers sets alpha = r for every module (get_peft_kwargs), a scale of 1."""
    if not metadata:
        return {m: 1.0 for m in modules}
    out = {}
    for m, rank in modules.items():
        r = _pattern(metadata.get("rank_pattern") or {}, m) or metadata.get("r") or rank
        alpha = _pattern(metadata.get("alpha_pattern") or {}, m) or metadata.get("lora_alpha") or r
        out[m] = float(alpha) / (math.sqrt(r) if metadata.get("use_rslora") else float(r))
    return out


def convert(source: Path, bundle: Path, out: Path, into: str | None = None, force: bool = False) -> dict[str, Any]:
    """Write the adapter of `source` for `bundle` to `out`; returns a summary. `into` sends the `transformer.`
    keys to that expert instead (diffusers' load_into_transformer_2)."""
    import torch
    from safetensors.numpy import save_file

    if out.exists() and not force:
        raise UserError(f"{out} already exists: choose another --out or pass --force to replace it")
    manifest = mf.read(bundle)
    converted, metadata = to_diffusers(lora_file(source))
    tensors: dict[str, np.ndarray] = {}
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    for key, value in converted.items():
        m = re.fullmatch(r"(transformer(?:_2)?)\.(.+)\.lora_([AB])\.(weight|bias)", key)
        if not m:
            raise UserError(f"LoRA key {key!r} is not a LoRA A/B weight of the transformer (text encoder and "
                            "other LoRAs are not supported)")
        prefix, module, which, kind = m.groups()
        if which == "A" and kind == "bias":
            raise UserError(f"LoRA key {key!r}: lora_A has no bias")
        pairs.setdefault((prefix, module), {})[which + ("_bias" if kind == "bias" else "")] = value
    scales = {}
    for prefix in {prefix for prefix, _ in pairs}:  # as diffusers' load_lora_adapter: metadata of the component
        ranks = {module: int(p["A"].shape[0]) for (g, module), p in pairs.items() if g == prefix and "A" in p}
        config = {k.removeprefix(prefix + "."): v for k, v in metadata.items() if k.startswith(prefix + ".")}
        scales[prefix] = module_scales(ranks, config)
    for (prefix, module), p in sorted(pairs.items()):
        group = into if into is not None and prefix == "transformer" else prefix
        scale = np.float32(scales[prefix].get(module, 1.0))
        where = f"{group}.{module}"
        if group not in GROUPS or group not in manifest.weights:
            raise UserError(f"LoRA targets {group}, which bundle {bundle} ({manifest.kind}) does not have "
                            f"(its experts: {', '.join(g for g in GROUPS if g in manifest.weights)})")
        if "A" not in p or "B" not in p:
            raise UserError(f"LoRA module {where} has lora_{'A' if 'A' not in p else 'B'} missing")
        a = p["A"].to(torch.float32).numpy()
        b = p["B"].to(torch.float32).numpy() * scale
        if a.ndim != 2 or b.ndim != 2:
            raise UserError(f"LoRA module {where} is not a linear layer (A {list(a.shape)}, B {list(b.shape)}): "
                            "only linear LoRAs are supported")
        tensors[f"{where}.weight.lora_A"] = np.ascontiguousarray(a)
        tensors[f"{where}.weight.lora_B"] = np.ascontiguousarray(b)
        if "B_bias" in p:
            tensors[f"{where}.bias.delta"] = p["B_bias"].to(torch.float32).numpy() * scale
    if not tensors:
        raise UserError(f"LoRA {source} has no transformer weights")
    from runtime.lora import check_tensors

    targets = check_tensors(tensors, manifest, f"LoRA {source}")
    header = {"format": FORMAT, "bundle_id": manifest.bundle_id, "source": str(source),
              "targets": str(len(targets))}
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata=header)
    log.info("wrote %s: %d tensors of %s for bundle %s", out, len(targets),
             ", ".join(sorted({g for g, _ in targets})), manifest.bundle_id)
    return {"bundle_id": manifest.bundle_id, "targets": len(targets)}
