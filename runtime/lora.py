"""LoRA adapters merged into a bundle's weights as they are placed, on each device's own shard.

An adapter (written by `python -m export lora`, see export/lora.py for the layout) holds, per
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
with LoRA inputs, and a rank-r product per layer at every step: measured on an H200 at the 1.3B's widths and 480p,
1.44x the linears' time per step, more than a switch's merge after 2.3 steps (BENCHMARKS.md section 9).

A pipeline switches sets between runs (runtime/adapters.py, Bundle.set_loras): the tensors either set changes are
merged again, by `apply`, from their unmodified copy (the weight file's mapping), so the result is always a fresh
load's, bit for bit.
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
    return check_shapes({key: tuple(np.shape(value)) for key, value in tensors.items()}, manifest, label)


def check_shapes(shapes: dict[str, tuple[int, ...]], manifest: mf.Manifest, label: str) -> list[tuple[str, str]]:
    """`check_tensors` on the adapter tensors' shapes alone (its file's header: nothing read)."""
    found: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        m = _KEY.fullmatch(key)
        if not m:
            raise UserError(f"{label}: tensor {key!r} is not an adapter tensor (make adapters with python -m "
                            "export lora)")
        group, name, part = m.groups()
        found.setdefault((group, name), {})[part] = tuple(shape)
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


@dataclass(frozen=True)
class Adapter:
    """What an adapter file offers, from its header and its tensors' shapes (no data read): the experts it changes
    (`groups`) and those it may be applied to instead (`targets`: on a two-expert bundle, an adapter of one expert fits
    the other, whose tensors have the same names and shapes), its rank (the largest of its layers') and how many of
    the bundle's tensors it changes."""

    name: str
    path: Path
    rank: int
    groups: tuple[str, ...]
    targets: tuple[str, ...]
    tensors: int


def _open(path: Path, manifest: mf.Manifest, label: str) -> Any:
    """The adapter file opened with safetensors' safe_open, its header checked (a wan-aot adapter of this bundle)."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise UserError(f"{label} does not exist (make one with python -m export lora SOURCE --bundle BUNDLE "
                        "--out ADAPTER.safetensors)")
    f = safe_open(str(path), framework="numpy")
    header = f.metadata() or {}
    if header.get("format") != FORMAT:
        raise UserError(f"{label} is not a wan-aot adapter: convert the LoRA with python -m export lora "
                        f"{path} --bundle BUNDLE --out ADAPTER.safetensors")
    if header.get("bundle_id") != manifest.bundle_id:
        raise UserError(f"{label} was made for bundle {header.get('bundle_id')}, not this one "
                        f"({manifest.bundle_id}): convert the LoRA again with --bundle this bundle")
    return f


def retarget(keys: dict[str, Any], into: str | None) -> dict[str, Any]:
    """An adapter's tensors (by key) applied to expert `into` (None: where they are): an adapter of one expert moved to
    the other (Wan2.2-Lightning's files are one per expert; the same file may serve either), an adapter of both
    restricted to that expert's part."""
    if into is None:
        return dict(keys)
    groups = {_KEY.fullmatch(k).group(1) for k in keys}
    if into in groups:
        return {k: v for k, v in keys.items() if _KEY.fullmatch(k).group(1) == into}
    (group,) = groups  # one expert's adapter, moved
    return {into + k[len(group):]: v for k, v in keys.items()}


def describe(path: Path, manifest: mf.Manifest, name: str | None = None) -> Adapter:
    """The adapter at `path` as it fits this bundle, from its header (UserError naming the file if it does not)."""
    from safetensors import SafetensorError

    label = f"LoRA adapter {path}"
    try:
        f = _open(path, manifest, label)
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except SafetensorError as e:
        raise UserError(f"cannot read {label}: {e}") from None
    targets = check_shapes(shapes, manifest, label)
    groups = tuple(g for g in GROUPS if any(t == g for t, _ in targets))
    fits = []
    for into in kinds.get(manifest.kind).expert_groups:
        try:
            check_shapes(retarget(shapes, into), manifest, label)
            fits.append(into)
        except UserError:
            pass
    rank = max((shape[0] for k, shape in shapes.items() if k.endswith(".lora_A")), default=0)
    return Adapter(name=name or Path(path).name.removesuffix(".safetensors"), path=Path(path), rank=int(rank),
                   groups=groups, targets=tuple(fits), tensors=len(targets))


def read(path: Path, scale: float, manifest: mf.Manifest, into: str | None = None) -> dict[tuple[str, str], Update]:
    """An adapter's updates, checked against the bundle (its header names the bundle it was made for); `into` applies
    them to that expert (`retarget`)."""
    from safetensors import SafetensorError

    label = f"LoRA adapter {path}"
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise UserError(f"{label}: the scale must be a finite number, got {scale!r}")
    try:
        f = _open(path, manifest, label)
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise UserError(f"cannot read {label}: {e}") from None
    check_tensors(tensors, manifest, label)
    if into is not None:
        if into not in manifest.weights or into not in GROUPS:
            raise UserError(f"{label}: this bundle ({manifest.kind}) has no expert {into}")
        tensors = retarget(tensors, into)
        check_tensors(tensors, manifest, f"{label} applied to {into}")
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
    replaced. The tensors are replaced in `arrays` itself (returned), one at a time: a device holds the unmerged and
    the merged copy of one tensor at once, not of all."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from .distributed import put

    out = arrays
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
