"""The LoRA sets a pipeline switches between, run by run: adapters named in a directory (`runtime.load(...,
lora_dir=DIR)`, `runtime serve --lora-dir DIR`) or given by path, each at a scale and optionally on one expert.

A set is resolved here (names to files, experts to weight groups), keyed (the files' identity, scales and experts, in
order: the bundle switches only when the key changes) and read into the updates runtime/bundle.py merges, from the
unmodified weights, into the tensors they change (Bundle.set_loras). Adapter files are read when a set is switched to,
not kept in memory: a server offering many adapters holds only the weights of the set it runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import kinds, lora
from . import manifest as mf
from .errors import UserError

# What a run calls a two-expert bundle's experts (the request field `expert`, `loras=[(name, scale, expert)]`): the
# high-noise expert (`transformer`, above the boundary timestep) and the low-noise one (`transformer_2`).
EXPERTS = {"high": "transformer", "low": "transformer_2"}
SUFFIX = ".safetensors"

LoraSpec = Sequence[Any]  # (path or name, scale) or (path or name, scale, expert)


@dataclass(frozen=True)
class Resolved:
    """One adapter of a set: its file, scale and the expert it is applied to (None: those it was made for)."""

    path: Path
    scale: float
    into: str | None = None


def expert_name(group: str, manifest: mf.Manifest) -> str:
    """A weight group as runs and the API name it: `high` / `low` on two-expert bundles, else `transformer`."""
    if kinds.get(manifest.kind).experts < 2:
        return group
    return next(name for name, g in EXPERTS.items() if g == group)


def scan(lora_dir: Path, manifest: mf.Manifest) -> dict[str, lora.Adapter]:
    """The adapters in `lora_dir` by name (file name without .safetensors), each checked against the bundle from its
    header and shapes; UserError (one line naming the file) for one that does not fit, or a directory without any."""
    where = Path(lora_dir)
    if not where.is_dir():
        raise UserError(f"--lora-dir {where} is not a directory (it holds the adapters made by python -m export "
                        "lora ... --bundle BUNDLE --out DIR/NAME.safetensors)")
    files = sorted(p for p in where.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
    if not files:
        raise UserError(f"--lora-dir {where} holds no .safetensors adapters: make them with python -m export lora "
                        f"SOURCE --bundle BUNDLE --out {where}/NAME.safetensors")
    out = {}
    for path in files:
        try:
            out[path.name[: -len(SUFFIX)]] = lora.describe(path, manifest)
        except UserError as e:
            raise UserError(f"--lora-dir {where}: {path.name} does not fit this bundle: {e}") from None
    return out


def resolve(loras: Sequence[LoraSpec] | None, manifest: mf.Manifest,
            named: dict[str, lora.Adapter] | None = None) -> list[Resolved]:
    """A set as given (each (path or name, scale[, expert])) to files, scales and weight groups; UserError for a name
    that is neither offered nor a file, a scale that is not a finite number, or an expert this bundle lacks."""
    out = []
    experts = kinds.get(manifest.kind).experts
    for item in loras or []:
        if isinstance(item, (str, Path)) or not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise UserError(f"loras must be a list of (path or name, scale) or (path or name, scale, expert), got "
                            f"{item!r}")
        source, scale, *rest = item
        expert = rest[0] if rest else None
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise UserError(f"LoRA {source}: the scale must be a finite number, got {scale!r}")
        if not isinstance(source, (str, Path)):
            raise UserError(f"LoRA {source!r}: give an adapter's path or name")
        if isinstance(source, str) and named is not None and source in named:
            path = named[source].path
        else:
            path = Path(source)
            if not path.is_file():
                offered = f", nor one of the adapters offered ({', '.join(sorted(named))})" if named else ""
                raise UserError(f"LoRA adapter {source} does not exist{offered}: make one with python -m export "
                                "lora SOURCE --bundle BUNDLE --out ADAPTER.safetensors")
        into = None
        if expert is not None:
            if experts < 2:
                raise UserError(f"LoRA {source}: expert {expert!r} is for two-expert bundles; this one "
                                f"({manifest.kind}) has one")
            if expert not in EXPERTS:
                raise UserError(f"LoRA {source}: expert must be one of {', '.join(EXPERTS)}, got {expert!r}")
            into = EXPERTS[expert]
        out.append(Resolved(path, float(scale), into))
    return out


def key(resolved: Sequence[Resolved]) -> tuple[Any, ...]:
    """What identifies a set's result: each file (resolved path, size, modification time), scale and expert, in order
    (the merge adds them in order, so another order rounds differently)."""
    out = []
    for r in resolved:
        try:
            st = r.path.stat()
        except OSError:
            raise UserError(f"LoRA adapter {r.path} does not exist (any more)") from None
        out.append((str(r.path.resolve()), st.st_size, st.st_mtime_ns, r.scale, r.into))
    return tuple(out)


def updates(resolved: Sequence[Resolved], manifest: mf.Manifest) -> dict[str, dict[str, list[lora.Update]]]:
    """group -> tensor -> the updates of every adapter of the set, in order (runtime/lora.py), read from the files."""
    merged: dict[str, dict[str, list[lora.Update]]] = {}
    for r in resolved:
        for (group, name), update in lora.read(r.path, r.scale, manifest, r.into).items():
            merged.setdefault(group, {}).setdefault(name, []).append(update)
    return merged


def describe_set(resolved: Sequence[Resolved]) -> str:
    """A set in a log line: `name@scale[:expert] + ...`, or `none`."""
    parts = [f"{r.path.name.removesuffix(SUFFIX)}@{r.scale:g}" + (f":{r.into}" if r.into else "") for r in resolved]
    return " + ".join(parts) or "none"
