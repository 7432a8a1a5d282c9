"""DiT checkpoints that are already quantized, in lightx2v's layout, attached as they are.

lightx2v (and the checkpoints made with its converter) keep the original Wan tensor names
(`blocks.N.self_attn.q.weight`, ...), store each quantized layer's weight in int8 or
float8_e4m3fn [out, in] with a per-row `*.weight_scale` [out, 1] (fp32, symmetric absmax),
and everything else unquantized: the layout export/quantize.py writes, under other names.
The names are mapped with diffusers' own converter of the original Wan layout; every
tensor must then be one the bundle lists, stored as the bundle's mode stores it (a file
of another mode, or one that quantizes other layers, is refused naming the tensor).
Unquantized tensors are cast to the bundle's dtype; nothing is expanded to bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime import manifest as mf
from runtime.errors import UserError

from .quantize import STORAGE, scale_name


def files_of(path: Path) -> list[Path]:
    """A .safetensors file, or every .safetensors file of a directory (a sharded checkpoint)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise UserError(f"--dit-weights {path} holds no .safetensors file")
        return files
    if not path.is_file():
        raise UserError(f"--dit-weights {path} does not exist")
    return [path]


def diffusers_names(keys: list[str]) -> dict[str, str]:
    """Original Wan tensor names -> diffusers' (through diffusers' single-file converter, which only renames)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    renamed = convert_wan_transformer_to_diffusers({k: k for k in keys})
    return {old: new for new, old in renamed.items()}


# safetensors dtype names -> torch's, for the checks on the header
_ST = {"I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F32": "float32", "F16": "float16",
       "BF16": "bfloat16", "F64": "float64", "I32": "int32", "I64": "int64", "U8": "uint8", "BOOL": "bool"}
_FLOAT = ("float32", "float16", "bfloat16", "float64")


def check_lightx2v(path: Path, wf: mf.WeightFile, group: str, computed: set[str] = frozenset()
                   ) -> dict[str, tuple[Path, str]]:
    """Check a lightx2v-layout checkpoint against the bundle's WeightFile `wf` from its headers alone (no tensor is
    read, so a mismatch is found before anything is written); returns diffusers name -> (file, original name).
    `computed`: tensors no checkpoint holds (the RoPE tables, which the model's constructor computes)."""
    from safetensors import SafetensorError, safe_open

    label = f"--dit-weights {path}"
    where: dict[str, tuple[Path, str]] = {}
    header: dict[str, tuple[str, tuple[int, ...]]] = {}
    try:
        for file in files_of(path):
            with safe_open(str(file), framework="pt") as f:
                for old, new in diffusers_names(list(f.keys())).items():
                    sl = f.get_slice(old)
                    where[new] = (file, old)
                    header[new] = (_ST.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))
    except SafetensorError as e:
        raise UserError(f"cannot read {label}: {e}") from None
    for new, (_, old) in where.items():
        if new not in wf.tensors:
            raise UserError(f"{label}: tensor {old} is not part of this bundle's {group} (another model, or a layout "
                            "that quantizes other layers): attach the checkpoint of the model the bundle was built "
                            "for")
    scales = {scale_name(w): w for w in wf.quantized}
    for name, spec in wf.tensors.items():
        shown = where[name][1] if name in where else name
        if name not in header:
            if name in computed:
                continue
            what = "its per-row scale" if name in scales else "it"
            raise UserError(f"{label} lacks tensor {shown} ({what}: the bundle's {group} needs it): a "
                            f"{'--quantize ' + wf.quantized[scales[name]] if name in scales else 'complete'} "
                            "checkpoint in lightx2v's layout is needed")
        dtype, shape = header[name]
        if name in wf.quantized:
            want = STORAGE[wf.quantized[name]]
            if dtype != want:
                raise UserError(f"{label}: tensor {shown} is {dtype} but this --quantize {wf.quantized[name]} bundle "
                                f"stores it as {want} with a per-row scale: attach a checkpoint of that mode, or "
                                "export the bundle with the file's mode")
            shape_ok = shape == tuple(spec.shape)
        elif name in scales:
            rows = wf.tensors[scales[name]].shape[0]
            if shape not in ((rows,), (rows, 1)) or dtype not in _FLOAT:
                raise UserError(f"{label}: scale {shown} is {dtype}{list(shape)}, not one float per output row "
                                f"([{rows}, 1])")
            shape_ok = True
        else:
            if dtype not in _FLOAT:
                raise UserError(f"{label}: tensor {shown} is stored as {dtype}, but this bundle keeps it in "
                                f"{spec.dtype} (its layout quantizes other layers): attach a checkpoint that "
                                "quantizes only the DiT blocks' linear layers")
            shape_ok = shape == tuple(spec.shape)
        if not shape_ok:
            raise UserError(f"{label}: tensor {shown} is {list(shape)} but the bundle expects {list(spec.shape)}: "
                            "attach the checkpoint of the model the bundle was built for")
    return where


def read_lightx2v(path: Path, wf: mf.WeightFile, group: str, computed: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The tensors of weight group `group` (as the bundle's WeightFile `wf` lists them) from a lightx2v-layout
    checkpoint (checked first, `check_lightx2v`): scales as float32 [out, 1], unquantized tensors cast to the
    bundle's dtypes, `computed` tensors where the file lacks them."""
    import torch
    from safetensors import safe_open

    computed = computed or {}
    where = check_lightx2v(path, wf, group, set(computed))
    scales = {scale_name(w) for w in wf.quantized}
    out: dict[str, Any] = {}
    handles: dict[Path, Any] = {}
    try:
        for name, spec in wf.tensors.items():
            if name not in where:
                out[name] = computed[name]
                continue
            file, old = where[name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            t = handles[file].get_tensor(old)
            if name in scales:
                t = t.reshape(-1, 1).to(torch.float32)
            elif name not in wf.quantized:
                t = t.to(getattr(torch, spec.dtype))
            out[name] = t.contiguous()
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out
