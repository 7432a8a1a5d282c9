"""DiT checkpoints that are already quantized, in lightx2v's layout, attached as they are.

lightx2v (and the checkpoints made with its converter) keep the original Wan tensor names
(`blocks.N.self_attn.q.weight`, ...), store each quantized layer's weight in int8 or
float8_e4m3fn [out, in] with a per-row `*.weight_scale` [out, 1] (fp32, symmetric absmax),
and everything else unquantized: the layout export/quantize.py writes, under other names.
The names are mapped with diffusers' own converter of the original Wan layout; every
tensor must then be one the bundle lists, stored as the bundle's mode stores it (a file
of another mode, or one that quantizes other layers, is refused naming the tensor).
Unquantized tensors are cast to the bundle's dtype; nothing is expanded to bf16.

The same names come from a training run's DCP folder (export/dcp.py, TorchTitan's Wan experiment): there, keys that
are not the bundle's (the optimizer's, the scheduler's) are other state and left unread, where a safetensors file
holding a tensor the bundle lacks is refused.
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
            raise UserError(f"--dit-weights {path} holds no .safetensors file, nor a torch.distributed.checkpoint "
                            "(.metadata, or step-N folders)")
        return files
    if not path.is_file():
        raise UserError(f"--dit-weights {path} does not exist")
    if path.suffix in (".pt", ".pth", ".bin", ".ckpt", ".pkl"):
        raise UserError(f"--dit-weights {path} is a pickle ({path.suffix}), which export never unpickles (it could run "
                        "anything): convert it to .safetensors, or give a torch.distributed.checkpoint folder")
    return [path]


class _Files:
    """Original-layout .safetensors files: `entries` (name -> (dtype, shape), from the headers) and `tensor(name)`."""

    extra_ok = False  # a tensor the bundle lacks means another model or layout

    def __init__(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.label = f"--dit-weights {path}"
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._file: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        try:
            for file in files_of(path):
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        self.entries[name] = (_ST.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))
                        self._file[name] = file
        except SafetensorError as e:
            raise UserError(f"cannot read {self.label}: {e}") from None

    def tensor(self, name: str) -> Any:
        from safetensors import safe_open

        file = self._file[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt").__enter__()
        return self._handles[file].get_tensor(name)

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()


def open_original(path: Path) -> Any:
    """--dit-weights PATH: a DCP folder (export/dcp.py) or .safetensors files, with `label`, `entries`, `tensor`,
    `close` and `extra_ok` (whether tensors the bundle lacks are other state, to skip)."""
    from . import dcp

    if dcp.is_dcp(path):
        folder = dcp.DcpFolder(path)
        folder.extra_ok = True  # type: ignore[attr-defined]
        folder.close = lambda: None  # type: ignore[attr-defined]
        return folder
    return _Files(path)


def diffusers_names(keys: list[str]) -> dict[str, str]:
    """Original Wan tensor names -> diffusers' (through diffusers' single-file converter, which only renames)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    renamed = convert_wan_transformer_to_diffusers({k: k for k in keys})
    return {old: new for new, old in renamed.items()}


# safetensors dtype names -> torch's, for the checks on the header
_ST = {"I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F32": "float32", "F16": "float16",
       "BF16": "bfloat16", "F64": "float64", "I32": "int32", "I64": "int64", "U8": "uint8", "BOOL": "bool"}
_FLOAT = ("float32", "float16", "bfloat16", "float64")


def check_lightx2v(path: Path, wf: mf.WeightFile, group: str, computed: set[str] = frozenset(),
                   src: Any = None) -> dict[str, str]:
    """Check an original-layout checkpoint (lightx2v's files, or a DCP folder) against the bundle's WeightFile `wf`
    from its headers or metadata alone (no tensor is read, so a mismatch is found before anything is written);
    returns diffusers name -> original name. `computed`: tensors no checkpoint holds (the RoPE tables, which the
    model's constructor computes)."""
    import difflib

    src = src or open_original(path)
    label = src.label
    where: dict[str, str] = {}
    header: dict[str, tuple[str, tuple[int, ...]]] = {}
    for old, new in diffusers_names(list(src.entries)).items():
        if src.extra_ok and new not in wf.tensors:
            continue  # the optimizer's, the scheduler's: not the model's
        where[new] = old
        header[new] = src.entries[old]
    for new, old in where.items():
        if new not in wf.tensors:
            raise UserError(f"{label}: tensor {old} is not part of this bundle's {group} (another model, or a layout "
                            "that quantizes other layers): attach the checkpoint of the model the bundle was built "
                            "for")
    if src.extra_ok:
        missing = [n for n in wf.tensors if n not in where and n not in computed]
        if missing:
            close = difflib.get_close_matches(missing[0], list(src.entries), n=1, cutoff=0.0)
            raise UserError(f"{label} holds no model tensor for {missing[0]} of this bundle's {group} (the closest "
                            f"key it has: {close[0] if close else 'none'}): a checkpoint of another architecture, or "
                            "no model state")
    scales = {scale_name(w): w for w in wf.quantized}
    for name, spec in wf.tensors.items():
        shown = where.get(name, name)
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
    """The tensors of weight group `group` (as the bundle's WeightFile `wf` lists them) from an original-layout
    checkpoint (checked first, `check_lightx2v`): scales as float32 [out, 1], unquantized tensors cast to the
    bundle's dtypes, `computed` tensors where the checkpoint lacks them."""
    import torch

    computed = computed or {}
    src = open_original(path)
    where = check_lightx2v(path, wf, group, set(computed), src)
    scales = {scale_name(w) for w in wf.quantized}
    out: dict[str, Any] = {}
    try:
        for name, spec in wf.tensors.items():
            if name not in where:
                out[name] = computed[name]
                continue
            t = src.tensor(where[name])
            if name in scales:
                t = t.reshape(-1, 1).to(torch.float32)
            elif name not in wf.quantized:
                t = t.to(getattr(torch, spec.dtype))
            out[name] = t.contiguous()
    finally:
        src.close()
    return out
