"""A training run's checkpoint as --dit-weights: a `torch.distributed.checkpoint` (DCP) folder, as TorchTitan writes
it (`step-N/` with `.metadata` and `__R_0.distcp` files), read in this one process with DCP's FileSystemReader: no
torchrun, no training code.

The folder may hold more than the model: `optimizer.*` (flattened, so its keys contain `blocks.N...` too),
`lr_scheduler`, `dataloader`, `train_state`. The model's tensors are taken by exact name: a key, once the wrappers'
segments are dropped (`_orig_mod.` from torch.compile, `_checkpoint_wrapped_module.` from activation checkpointing,
a leading `model.`), must be one of the architecture's original Wan names; everything else is left unread. Only the
tensors the bundle needs are loaded, each into a tensor of its stored dtype (fp32 or bf16; the caller casts).
"""

from __future__ import annotations

import io
import logging
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

from runtime.errors import UserError

log = logging.getLogger("export")
METADATA = ".metadata"
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")
_STEP = re.compile(r"step-(\d+)")


def is_dcp(path: Path) -> bool:
    """A DCP step folder, or a folder of `step-N` ones."""
    path = Path(path)
    return path.is_dir() and ((path / METADATA).is_file() or any(_steps(path)))


def _steps(path: Path) -> dict[int, Path]:
    return {int(m.group(1)): p for p in path.iterdir() if p.is_dir() and (m := _STEP.fullmatch(p.name))
            and (p / METADATA).is_file()}


def step_folder(path: Path) -> Path:
    """`path` if it is a step (it has `.metadata`), else its highest `step-N` (said in one line)."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    steps = _steps(path)
    if not steps:
        raise UserError(f"--dit-weights {path} is neither a DCP checkpoint (no {METADATA}) nor a folder of step-N ones")
    n = max(steps)
    log.info("--dit-weights %s: reading step-%d, the highest of %d step(s)", path, n, len(steps))
    return steps[n]


def model_name(key: str) -> str:
    """A DCP key without the segments wrappers leave: `model._orig_mod.blocks.0._checkpoint_wrapped_module.x` ->
    `blocks.0.x`."""
    for wrapper in _WRAPPERS:
        key = key.replace(wrapper, "")
    return key.removeprefix("model.")


def _allowed(module: str, name: str) -> bool:
    import torch

    if module == "torch.distributed.checkpoint.metadata":
        return not name.startswith("__")
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                              ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"), ("builtins", "set"),
                              ("builtins", "frozenset"), ("builtins", "slice")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise UserError(f"the DCP checkpoint's {METADATA} names {module}.{name}, which DCP's metadata never holds: "
                            "refusing to read it (it is a pickle, which could run anything)")
        return super().find_class(module, name)


def read_metadata(step: Path) -> Any:
    """DCP's Metadata of a step folder, through the restricted unpickler."""
    return _MetadataUnpickler(io.BytesIO((Path(step) / METADATA).read_bytes())).load()


def _reader(step: Path) -> Any:
    """DCP's FileSystemReader, its metadata read with the restricted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(step)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(step))


class DcpFolder:
    """The tensors of a DCP step folder by their model names (`model_name`): `entries` (name -> (dtype, shape), from
    the metadata alone) and `tensor(name)`, which loads that one tensor."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = step_folder(path)
        self.label = f"--dit-weights {path}"
        try:
            metadata = read_metadata(self.path)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (a damaged or foreign .metadata: one line)
            raise UserError(f"cannot read the DCP checkpoint {self.path}: {type(e).__name__}: {e}") from None
        self.keys: dict[str, str] = {}  # model name -> the key in the checkpoint
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        for key, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                name = model_name(key)
                if name not in self.keys or key.startswith("model."):  # the model's own over a look-alike
                    self.keys[name] = key
                    self.entries[name] = (str(meta.properties.dtype).removeprefix("torch."), tuple(meta.size))

    def tensor(self, name: str) -> Any:
        import torch
        import torch.distributed.checkpoint as dcp

        dtype, shape = self.entries[name]
        out = {self.keys[name]: torch.empty(shape, dtype=getattr(torch, dtype))}
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=_reader(self.path))
        return out[self.keys[name]]
