"""`python -m export lora SOURCE --bundle BUNDLE --out ADAPTER.safetensors`: a Wan LoRA as a bundle adapter.

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
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            first = next(iter(f.keys()), "")
        reason = f"{type(e).__name__}: {e}"
        reason = reason if len(reason) <= 100 else reason[:97] + "..."
        raise UserError(f"LoRA {path}: its tensor names (e.g. {first!r}) are not those of a Wan DiT LoRA in any "
                        f"format diffusers' Wan loader knows: a LoRA of another model? ({reason})") from None
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


def adapter_tensors(source: Path, into: str | None = None) -> dict[str, np.ndarray]:
    """The adapter tensors of LoRA `source` (layout above), for any bundle of its model. `into` sends the
    `transformer.` keys to that expert instead (diffusers' load_into_transformer_2). UserError for a file that is
    not a linear LoRA of the DiT."""
    import torch

    converted, metadata = to_diffusers(lora_file(source))
    tensors: dict[str, np.ndarray] = {}
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    for key, value in converted.items():
        m = re.fullmatch(r"(transformer(?:_2)?)\.(.+)\.lora_([AB])\.(weight|bias)", key)
        if not m:
            raise UserError(f"LoRA {source}: key {key!r} is not a LoRA A/B weight of the transformer (text encoder "
                            "and other LoRAs are not supported)")
        prefix, module, which, kind = m.groups()
        if which == "A" and kind == "bias":
            raise UserError(f"LoRA {source}: key {key!r}: lora_A has no bias")
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
        if "A" not in p or "B" not in p:
            raise UserError(f"LoRA {source}: module {where} has lora_{'A' if 'A' not in p else 'B'} missing")
        a = p["A"].to(torch.float32).numpy()
        b = p["B"].to(torch.float32).numpy() * scale
        if a.ndim != 2 or b.ndim != 2:
            raise UserError(f"LoRA {source}: module {where} is not a linear layer (A {list(a.shape)}, B "
                            f"{list(b.shape)}): only linear LoRAs are supported")
        tensors[f"{where}.weight.lora_A"] = np.ascontiguousarray(a)
        tensors[f"{where}.weight.lora_B"] = np.ascontiguousarray(b)
        if "B_bias" in p:
            tensors[f"{where}.bias.delta"] = p["B_bias"].to(torch.float32).numpy() * scale
    if not tensors:
        raise UserError(f"LoRA {source} has no transformer weights")
    return tensors


def check_groups(tensors: dict[str, np.ndarray], groups: list[str], label: str, owner: str = "this model") -> None:
    """Refuse an adapter that targets an expert the model (`owner`) lacks."""
    for group in sorted({key.split(".", 1)[0] for key in tensors}):
        if group not in GROUPS or group not in groups:
            raise UserError(f"{label} targets {group}, which {owner} does not have (its experts: "
                            f"{', '.join(g for g in GROUPS if g in groups)})")


def convert(source: Path, bundle: Path, out: Path, into: str | None = None, force: bool = False) -> dict[str, Any]:
    """Write the adapter of `source` for `bundle` to `out`; returns a summary. `into` sends the `transformer.`
    keys to that expert instead (diffusers' load_into_transformer_2)."""
    from safetensors.numpy import save_file

    if out.exists() and not force:
        raise UserError(f"{out} already exists: choose another --out or pass --force to replace it")
    manifest = mf.read(bundle)
    tensors = adapter_tensors(source, into)
    check_groups(tensors, list(manifest.weights), f"LoRA {source}", f"bundle {bundle} ({manifest.kind})")
    from runtime.lora import check_tensors

    targets = check_tensors(tensors, manifest, f"LoRA {source}")
    header = {"format": FORMAT, "bundle_id": manifest.bundle_id, "source": str(source),
              "targets": str(len(targets))}
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata=header)
    log.info("wrote %s: %d tensors of %s for bundle %s", out, len(targets),
             ", ".join(sorted({g for g, _ in targets})), manifest.bundle_id)
    return {"bundle_id": manifest.bundle_id, "targets": len(targets)}


MergeSpec = tuple[Path, float, str | None]  # (LoRA file, scale, the expert its `transformer.` keys go to, or None)


def parse_merge(text: str, into: str | None) -> MergeSpec:
    """--merge-lora FILE[:SCALE] (into None) / --merge-lora-2 FILE[:SCALE] (into "transformer_2")."""
    from runtime.lora import parse_spec

    path, scale = parse_spec(text)
    lora_file(path)  # a missing or non-safetensors file fails before the export starts
    return path, scale, into


def read_merges(merges: list[MergeSpec], shapes: dict[str, dict[str, tuple[int, ...]]]) -> list[tuple[dict, float]]:
    """Each --merge-lora's adapter tensors and scale, checked against the experts' tensor shapes (`shapes`: group ->
    tensor name -> shape, e.g. from the model built on `meta`) before any work: a file whose names match no weight of
    the model is refused naming one."""
    out = []
    for path, scale, into in merges:
        label = f"--merge-lora{'-2' if into else ''} {path}"
        tensors = adapter_tensors(path, into)
        check_groups(tensors, list(shapes), label)
        for key, value in tensors.items():
            group, rest = key.split(".", 1)
            name, part = rest.rsplit(".", 1)
            if name not in shapes[group]:
                raise UserError(f"{label}: its {part} for {group} tensor {name!r} matches no weight of the model (a "
                                "LoRA of another model?)")
            want = shapes[group][name]
            if part == "delta":
                ok = tuple(value.shape) == tuple(want)
            else:  # A (r, in) against W's columns, B (out, r) against its rows
                ok = len(want) == 2 and value.shape[1 if part == "lora_A" else 0] == want[1 if part == "lora_A" else 0]
            if not ok:
                raise UserError(f"{label}: {part} {list(value.shape)} does not fit {group} tensor {name} "
                                f"{list(want)} (a LoRA of another model size?)")
        out.append((tensors, scale))
    return out


def merge_into(params: dict[str, Any], group: str, adapters: list[tuple[dict, float]]) -> int:
    """W += scale x B @ A (and bias += scale x delta) in place, for each adapter's tensors of `group`, accumulated in
    float32 and rounded once to W's dtype, as the runtime merges adapters at load (runtime/lora.py). Returns how
    many tensors changed."""
    import torch

    changed: dict[str, Any] = {}
    for tensors, scale in adapters:
        for key, value in tensors.items():
            g, rest = key.split(".", 1)
            name, part = rest.rsplit(".", 1)
            if g != group or part == "lora_A":
                continue
            base = changed.setdefault(name, params[name].detach().to(torch.float32).clone())
            if part == "lora_B":
                a = torch.from_numpy(tensors[f"{g}.{name}.lora_A"])
                base += scale * (torch.from_numpy(value) @ a)
            else:
                base += scale * torch.from_numpy(value)
    for name, value in changed.items():
        params[name].data.copy_(value.to(params[name].dtype))
    return len(changed)


def provenance(merges: list[MergeSpec]) -> dict[str, Any]:
    """What the manifest's `source` records of the LoRAs merged into a bundle's weights ({} if none): each file's
    name, sha256, scale and the expert its `transformer` keys went to."""
    if not merges:
        return {}
    return {"merged_loras": [{"file": Path(p).name, "sha256": mf.sha256_file(lora_file(p)), "scale": scale,
                              "into": into or "transformer"} for p, scale, into in merges]}
