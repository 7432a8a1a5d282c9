"""LoRA adapters merged into a bundle's weights as they are placed, on each device's own shard.

An adapter (written by `python -m export --lora`, see export/lora.py for the layout) holds, per
weight of an expert, A (r, in) and B (out, r) with its PEFT scale folded in, and LoRA bias deltas.
`runtime.load(bundle, loras=[(path, scale), ...])` reads the adapters' headers and shapes when the
bundle opens (an adapter for another bundle, a tensor the bundle lacks, a shape that differs: one
clear error before any work), and when a weight group is placed merges

    W + sum_i scale_i x B_i @ A_i        (fp32 accumulation, rounded once to W's dtype)

in one jitted program per tensor whose output keeps W's sharding: B is placed split like W's rows
and A like W's columns, so each device computes its own shard from its own slices; no weight is
ever whole on the host.

A quantized weight (export/quantize.py) is merged into its dequantized value, q x scale, and
quantized again with new per-row scales, in the same program: the bundle's programs take it as
they always do, and the cost is one more rounding (tests/test_quantize.py measures it against
merging into the unquantized bundle). Applying the adapter unmerged would instead need programs
with LoRA inputs, and a rank-r product per layer at every step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import kinds
from . import manifest as mf
from .errors import UserError

FORMAT = "wan-aot-lora"
GROUPS = kinds.DIT_GROUPS  # what adapters may target: the DiT experts
_KEY = re.compile(r"(transformer(?:_2)?)\.(.+)\.(lora_A|lora_B|delta)")


@dataclass(frozen=True)
class Update:
    """One adapter's change to one tensor: `scale` x (b @ a), or `scale` x delta (b, with a None)."""

    a: np.ndarray | None
    b: np.ndarray
    scale: float


def parse_spec(text: str) -> tuple[Path, float]:
    """'ADAPTER[:SCALE]' -> (path, scale); the scale defaults to 1."""
    path, sep, tail = text.rpartition(":")
    if sep:
        try:
            scale = float(tail)
        except ValueError:
            return Path(text), 1.0
        if not math.isfinite(scale):
            raise UserError(f"--lora {text}: the scale must be a finite number")
        return Path(path), scale
    return Path(text), 1.0


def check_tensors(tensors: dict[str, Any], manifest: mf.Manifest, label: str) -> list[tuple[str, str]]:
    """The (group, tensor) pairs an adapter's tensors change; UserError if any does not fit the bundle."""
    found: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
    for key, value in tensors.items():
        m = _KEY.fullmatch(key)
        if not m:
            raise UserError(f"{label}: tensor {key!r} is not an adapter tensor (make adapters with python -m "
                            "export --lora)")
        group, name, part = m.groups()
        found.setdefault((group, name), {})[part] = tuple(np.shape(value))
    for (group, name), parts in found.items():
        wf = manifest.weights.get(group)
        if wf is None:
            raise UserError(f"{label} changes {group}, which this bundle ({manifest.kind}) does not have")
        spec = wf.tensors.get(name)
        if spec is None:
            raise UserError(f"{label} changes {group} tensor {name!r}, which this bundle does not have")
        want = tuple(spec.shape)
        if "delta" in parts:
            got = parts["delta"]
            ok = set(parts) == {"delta"} and got == want
        else:
            a, b = parts.get("lora_A"), parts.get("lora_B")
            ok = a is not None and b is not None and len(a) == len(b) == 2 == len(want) and a[0] == b[1] \
                and (b[0], a[1]) == want
            got = (b[0], a[1]) if a is not None and b is not None and len(a) == len(b) == 2 else (a, b)
        if not ok:
            raise UserError(f"{label}: {group} tensor {name!r} is {list(want)} in the bundle, the adapter's "
                            f"update is {list(got)}: was the adapter made for another model?")
    return sorted(found)


def read(path: Path, scale: float, manifest: mf.Manifest) -> dict[tuple[str, str], Update]:
    """An adapter's updates, checked against the bundle (its header names the bundle it was made for)."""
    from safetensors import SafetensorError, safe_open

    label = f"LoRA adapter {path}"
    if not Path(path).is_file():
        raise UserError(f"{label} does not exist (make one with python -m export --lora SOURCE --bundle BUNDLE "
                        "--out ADAPTER.safetensors)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise UserError(f"{label}: the scale must be a finite number, got {scale!r}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
            if header.get("format") != FORMAT:
                raise UserError(f"{label} is not a wan-aot adapter: convert the LoRA with python -m export --lora "
                                f"{path} --bundle BUNDLE --out ADAPTER.safetensors")
            if header.get("bundle_id") != manifest.bundle_id:
                raise UserError(f"{label} was made for bundle {header.get('bundle_id')}, not this one "
                                f"({manifest.bundle_id}): convert the LoRA again with --bundle this bundle")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise UserError(f"cannot read {label}: {e}") from None
    check_tensors(tensors, manifest, label)
    out = {}
    for key, value in tensors.items():
        group, name, part = _KEY.fullmatch(key).groups()
        if part == "delta":
            out[group, name] = Update(None, value.astype(np.float32), float(scale))
        elif part == "lora_B":
            out[group, name] = Update(tensors[f"{group}.{name}.lora_A"].astype(np.float32), value.astype(np.float32),
                                      float(scale))
    return out


def read_all(loras: list[tuple[str | Path, float]] | None, manifest: mf.Manifest
             ) -> dict[str, dict[str, list[Update]]]:
    """group -> tensor -> the updates of every adapter, in order."""
    merged: dict[str, dict[str, list[Update]]] = {}
    for item in loras or []:
        try:
            path, scale = item
        except (TypeError, ValueError):
            raise UserError(f"loras must be a list of (path, scale) pairs, got {item!r}") from None
        for (group, name), update in read(Path(path), scale, manifest).items():
            merged.setdefault(group, {}).setdefault(name, []).append(update)
    return merged


def _merge(w: Any, parts: list[tuple[Any, Any]], scales: Any) -> Any:
    """W + sum scale_i x (B_i @ A_i, or delta_i), accumulated in fp32 and rounded once to W's dtype."""
    import jax.numpy as jnp

    acc = w.astype(jnp.float32)
    for i, (a, b) in enumerate(parts):
        acc = acc + scales[i] * (b if a is None else jnp.dot(b, a, preferred_element_type=jnp.float32))
    return acc.astype(w.dtype)


def _merge_quantized(w: Any, scale: Any, parts: list[tuple[Any, Any]], scales: Any) -> tuple[Any, Any]:
    """`_merge` into the dequantized weight, quantized again per row (symmetric absmax, as export/quantize.py)."""
    import jax.numpy as jnp

    qmax = 127.0 if w.dtype == jnp.int8 else float(jnp.finfo(w.dtype).max)
    acc = _merge(w.astype(jnp.float32) * scale.astype(jnp.float32), parts, scales)
    amax = jnp.max(jnp.abs(acc), axis=1, keepdims=True)
    new_scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(scale.dtype)
    x = jnp.clip(acc / new_scale, -qmax, qmax)
    return (jnp.round(x) if w.dtype == jnp.int8 else x).astype(w.dtype), new_scale


def apply(arrays: dict[str, Any], updates: dict[str, list[Update]], scale_names: dict[str, str] | None = None
          ) -> dict[str, Any]:
    """`arrays` (placed weights of one group) with the updates merged, each tensor keeping its sharding; a quantized
    tensor (a key of `scale_names`: tensor -> its scale, WeightFile.scale_of) is merged with its scale and both are
    replaced."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from .distributed import put

    out = dict(arrays)
    for name, ups in updates.items():
        w = arrays[name]
        if not isinstance(w.sharding, NamedSharding):  # not expected: the bundle places with NamedShardings
            raise TypeError(f"{name} is placed with {w.sharding}, not a NamedSharding")
        spec = tuple(w.sharding.spec) + (None,) * (w.ndim - len(w.sharding.spec))
        mesh = w.sharding.mesh
        parts = []
        for u in ups:
            if u.a is None:
                parts.append((None, put(u.b, NamedSharding(mesh, PartitionSpec(*spec)))))
            else:  # B split like W's rows, A like W's columns: each device's product is its own shard of W
                parts.append((put(u.a, NamedSharding(mesh, PartitionSpec(None, spec[1]))),
                              put(u.b, NamedSharding(mesh, PartitionSpec(spec[0], None)))))
        scales = put(np.asarray([u.scale for u in ups], np.float32), NamedSharding(mesh, PartitionSpec()))
        if name in (scale_names or {}):
            s = arrays[scale_names[name]]
            out[name], out[scale_names[name]] = jax.jit(_merge_quantized, out_shardings=(w.sharding, s.sharding))(
                w, s, parts, scales)
        else:
            out[name] = jax.jit(_merge, out_shardings=w.sharding)(w, parts, scales)
    return out
