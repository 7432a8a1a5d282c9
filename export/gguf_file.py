"""GGUF DiT files as --dit-weights (city96's Wan 2.1/2.2 GGUFs, or any file in their layout), read with the `gguf`
package (llama.cpp's own reader and dequantizers), never a parser of ours.

The layout is the original Wan one (`blocks.N.self_attn.q.weight`, 1-D norms, biases and modulation tables in F32),
so names map as the lightx2v and DCP paths map them (diffusers' single-file converter, export/prequantized.py). Each
tensor is dequantized in float32 by `gguf.quants.dequantize` and then stored as the bundle stores it:

- an unquantized bundle tensor: cast once to its dtype (bf16 or fp32);
- a tensor a `--quantize` bundle quantizes: quantized per output row from the dequantized values, exactly as export
  quantizes a checkpoint's weights (export/quantize.py). A Q8_0 tensor thus stays 8-bit, but its 32-value blocks'
  scales become one scale per row: a requantization, whose error BENCHMARKS.md section 15 measures.

GGUF lists dimensions innermost first (ggml's ne[0] is a row's length); the reader's `shape` is in that order and
its `data` in numpy's, so a tensor's shape here is the reversed `shape`, as diffusers' GGUF loader has it.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from runtime import manifest as mf
from runtime.errors import UserError

from .prequantized import diffusers_names
from .quantize import quantize_tensor, scale_name

# What `gguf.quants.dequantize` reads and diffusers' GGUF loader reads too (the IQ and ternary types are not Wan's)
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def is_gguf(path: Path) -> bool:
    """A .gguf file (by its name; its magic is checked when it is opened)."""
    return Path(path).suffix.lower() == ".gguf"


class GgufFile:
    """A GGUF file's tensors by name: `entries` (name -> (GGML type name, shape in numpy's order), from the header
    alone) and `tensor(name)`, one tensor dequantized to a float32 numpy array."""

    extra_ok = False  # a tensor the bundle lacks means another model or layout

    def __init__(self, path: Path) -> None:
        self.label = f"--dit-weights {path}"
        if not Path(path).is_file():
            raise UserError(f"{self.label} does not exist")
        import gguf

        try:
            reader = gguf.GGUFReader(str(path), "r")
        except Exception as e:  # noqa: BLE001  (a truncated or foreign file: one line)
            raise UserError(f"cannot read {self.label} as GGUF ({type(e).__name__}: {e}): is it a whole .gguf "
                            "file?") from None
        self._tensors = {t.name: t for t in reader.tensors}
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {
            t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}

    def tensor(self, name: str) -> Any:
        import numpy as np
        from gguf.quants import dequantize

        t = self._tensors[name]
        return np.array(dequantize(t.data, t.tensor_type), np.float32).reshape(self.entries[name][1])

    def close(self) -> None:
        self._tensors.clear()


def check(path: Path, wf: mf.WeightFile, group: str, computed: set[str] = frozenset(),
          src: GgufFile | None = None) -> dict[str, str]:
    """Check a GGUF file against the bundle's WeightFile `wf` from its header alone (nothing dequantized, so a bad
    file is refused before anything is written); returns bundle name -> the file's name. `computed`: tensors no
    checkpoint holds (the RoPE tables)."""
    src = src or GgufFile(path)
    label = src.label
    for name, (qtype, _) in src.entries.items():
        if qtype not in SUPPORTED:
            raise UserError(f"{label}: tensor {name} is {qtype}, a GGUF type export does not read (it reads "
                            f"{', '.join(SUPPORTED)}): use a file quantized to one of those")
    where = {new: old for old, new in diffusers_names(list(src.entries)).items()}
    scales = {scale_name(w) for w in wf.quantized}
    for new, old in where.items():
        if new not in wf.tensors or new in scales:
            raise UserError(f"{label}: tensor {old} is not part of this bundle's {group} (another model, or another "
                            "layout): give the GGUF of the model the bundle was built for")
    missing = [n for n in wf.tensors if n not in where and n not in computed and n not in scales]
    if missing:
        close = difflib.get_close_matches(missing[0], list(src.entries), n=1, cutoff=0.0)
        raise UserError(f"{label} holds no tensor for {missing[0]} of this bundle's {group} (the closest it has: "
                        f"{close[0] if close else 'none'}): a file of another architecture")
    for new, old in where.items():
        shape = src.entries[old][1]
        if shape != tuple(wf.tensors[new].shape):
            raise UserError(f"{label}: tensor {old} is {list(shape)} but the bundle's {group} expects "
                            f"{list(wf.tensors[new].shape)}: give the GGUF of the model the bundle was built for")
    return where


def read(path: Path, wf: mf.WeightFile, group: str, computed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tensors of weight group `group` (as the bundle's WeightFile `wf` lists them) from a GGUF file (checked
    first, `check`): dequantized in float32, then cast to the bundle's dtype, or quantized per row where the bundle
    quantizes (its --quantize mode, with the scale beside); `computed` tensors where the file lacks them."""
    import torch

    computed = computed or {}
    src = GgufFile(path)
    where = check(path, wf, group, set(computed), src)
    out: dict[str, Any] = {}
    try:
        for name, spec in wf.tensors.items():
            if name in computed and name not in where:
                out[name] = computed[name]
            elif name in wf.quantized:
                out[name], out[scale_name(name)] = quantize_tensor(torch.from_numpy(src.tensor(where[name])),
                                                                   wf.quantized[name])
            elif name in where:
                out[name] = torch.from_numpy(src.tensor(where[name])).to(getattr(torch, spec.dtype)).contiguous()
    finally:
        src.close()
    return out
