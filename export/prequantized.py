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


def read_lightx2v(path: Path, wf: mf.WeightFile, group: str, computed: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The tensors of weight group `group` (as the bundle's WeightFile `wf` lists them) from a lightx2v-layout
    checkpoint, checked against the bundle's names, dtypes and shapes. `computed`: tensors no checkpoint holds (the
    RoPE tables, computed by the model's constructor), used where the file lacks them."""
    import torch
    from safetensors import SafetensorError, safe_open

    label = f"--dit-weights {path}"
    tensors: dict[str, Any] = {}
    original: dict[str, str] = {}
    try:
        for file in files_of(path):
            with safe_open(str(file), framework="pt") as f:
                keys = list(f.keys())
                for old, new in diffusers_names(keys).items():
                    tensors[new] = f.get_tensor(old)
                    original[new] = old
    except SafetensorError as e:
        raise UserError(f"cannot read {label}: {e}") from None
    for name, t in (computed or {}).items():
        if name in wf.tensors and name not in tensors:
            tensors[name] = t
    scales = {scale_name(w): w for w in wf.quantized}
    for new, old in original.items():
        if new not in wf.tensors:
            raise UserError(f"{label}: tensor {old} is not part of this bundle's {group} (another model, or a layout "
                            "that quantizes other layers): attach the checkpoint of the model the bundle was built "
                            "for")
    out: dict[str, Any] = {}
    for name, spec in wf.tensors.items():
        shown = next((o for n, o in original.items() if n == name), name)
        if name not in tensors:
            what = "its per-row scale" if name in scales else "it"
            raise UserError(f"{label} lacks tensor {shown} ({what}: the bundle's {group} needs it): a "
                            f"{'--quantize ' + wf.quantized[scales[name]] if name in scales else 'complete'} "
                            "checkpoint in lightx2v's layout is needed")
        t = tensors[name]
        if name in wf.quantized:
            want = getattr(torch, STORAGE[wf.quantized[name]])
            if t.dtype != want:
                raise UserError(f"{label}: tensor {shown} is {_dtype(t)} but this --quantize {wf.quantized[name]} "
                                f"bundle stores it as {_dtype(want)} with a per-row scale: attach a checkpoint of "
                                "that mode, or export the bundle with the file's mode")
        elif name in scales:
            rows = wf.tensors[scales[name]].shape[0]
            if tuple(t.shape) not in ((rows,), (rows, 1)) or not t.is_floating_point():
                raise UserError(f"{label}: scale {shown} is {_dtype(t)}{list(t.shape)}, not one float per output "
                                f"row ([{rows}, 1])")
            t = t.reshape(rows, 1).to(torch.float32)
        else:
            if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise UserError(f"{label}: tensor {shown} is stored as {_dtype(t)}, but this bundle keeps it in "
                                f"{spec.dtype} (its layout quantizes other layers): attach a checkpoint that "
                                "quantizes only the DiT blocks' linear layers")
            t = t.to(getattr(torch, spec.dtype))
        if tuple(t.shape) != tuple(spec.shape):
            raise UserError(f"{label}: tensor {shown} is {list(t.shape)} but the bundle expects {list(spec.shape)}: "
                            "attach the checkpoint of the model the bundle was built for")
        out[name] = t.contiguous()
    return out


def _dtype(t: Any) -> str:
    return str(getattr(t, "dtype", t)).removeprefix("torch.")
