"""Streaming safetensors writer.

`safetensors.*.save_file` serializes every tensor to bytes in memory before writing,
which doubles peak memory (the UMT5-XXL text encoder alone is 11 GB in bf16). The
format is a little-endian u64 header length, a JSON header (dtype, shape, byte
offsets per tensor) and the raw bytes, so we write it tensor by tensor: peak memory
is one tensor. The output is byte-for-byte deterministic (sorted names, no metadata).

Every tensor whose size is a multiple of 64 bytes (all large ones) starts on a 64-byte boundary
of the file: the header is padded with spaces (as the format allows) to end on one, and those
tensors come first, the others after them. The runtime maps the file and jax on CPU adopts an
aligned buffer as a device array without copying it (runtime/weights.py).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from runtime.manifest import TensorSpec
from runtime.weights import ALIGN

_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
           "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
           "float8_e4m3fn": "F8_E4M3"}


def _raw(t: Any) -> memoryview:
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.float8_e4m3fn:  # numpy has no float8: its bytes as they are
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def spec(t: Any) -> TensorSpec:
    """The TensorSpec of a torch tensor (also of a `meta` one)."""
    return TensorSpec(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))


def write(path: Path, tensors: dict[str, Any]) -> dict[str, TensorSpec]:
    """Write torch tensors to `path` in safetensors format; returns their specs by name."""
    names = sorted(tensors, key=lambda n: (tensors[n].numel() * tensors[n].element_size() % ALIGN != 0, n))
    header: dict[str, Any] = {}
    specs: dict[str, TensorSpec] = {}
    offset = 0
    for name in names:
        t = tensors[name]
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"cannot store {name} of dtype {dtype} in safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        specs[name] = spec(t)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            f.write(_raw(tensors[name]))
    path.chmod(0o644)
    return specs
