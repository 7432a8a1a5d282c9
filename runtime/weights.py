"""Reading a bundle's weight files into device arrays: mapped, not copied, and hashed on the way.

A weight file is mapped read-only (its pages are the kernel's page cache, shared with every process
that maps it), passes through sha256 front to back when it still has to be checked
(runtime/integrity.py), and each wanted tensor is placed on the devices from the mapping: on CPU,
jax adopts a 64-byte-aligned host buffer as the device array without copying it, so an exported
bundle (export/weights.py aligns its tensors) costs no copy and no extra memory at all (1.3B fp32:
5.7 GB placed in 0.2-1 s instead of read in 2.9 s, the same peak RSS); a tensor that is not aligned
(older bundles) is copied into an aligned buffer, and a sharded tensor's per-device shards are cut
from the mapping. A file whose hash does not match is refused after its last byte, before any
program can use its arrays.

The mapping ties the arrays to the file: replace a bundle that is in use by writing a new file (or
directory) and renaming it over the old one, never by truncating it in place (`cp` onto it), which
would fault the process that maps it.

The safetensors library has no call that reads into a caller's buffer, so the format's header
(a little-endian u64 length, then JSON with dtype, shape and byte offsets per tensor) is parsed
here, with the library's own rules: offsets contiguous from 0, inside the file, sized by the shape.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from . import manifest as mf
from .errors import BundleError
from .integrity import Checker, mismatch_message, sha256_stream

HEADER_LIMIT = 100 << 20  # safetensors' own limit on the JSON header
ALIGN = 64  # what XLA's CPU client needs to adopt a host buffer without copying it


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I32": np.int32,
              "I64": np.int64, "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F64": np.float64,
              "F8_E4M3": ml_dtypes.float8_e4m3fn}


def safetensors_dtype(st: str) -> np.dtype:
    return np.dtype(_ST_DTYPES.get(st, np.void))


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


def read_header(f: Any, size: int, label: str) -> list[Entry]:
    """The tensors of an open safetensors file, in file order."""
    def bad(why: str) -> BundleError:
        return BundleError(f"weights file {label} is not a valid safetensors file ({why}): re-copy or re-export "
                           "the bundle")

    head = f.read(8)
    if len(head) != 8:
        raise bad("shorter than its header")
    (n,) = struct.unpack("<Q", head)
    if n > HEADER_LIMIT or 8 + n > size:
        raise bad(f"header length {n}")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not an object")
    entries = []
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = safetensors_dtype(info["dtype"]), tuple(int(s) for s in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"entry {name!r}") from None
        if dtype == np.void or end - start != math.prod(shape) * dtype.itemsize:
            raise bad(f"entry {name!r} has dtype {info.get('dtype')} and {end - start} bytes for shape {list(shape)}")
        entries.append(Entry(name, dtype, shape, base + start, base + end))
    entries.sort(key=lambda e: (e.start, e.end))
    pos = base
    for e in entries:
        if e.start != pos:
            raise bad(f"tensor {e.name!r} does not start where the previous one ends")
        pos = e.end
    if pos != size:
        raise bad(f"data ends at byte {pos} of {size}")
    return entries


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 buffer whose data starts on an ALIGN-byte boundary."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip: skip + nbytes]


# MADV_POPULATE_READ (Linux 5.14+; Python 3.11's mmap module does not name it): fill a tensor's page tables now,
# in the loading thread, rather than fault by fault in the first program that reads it. Only wanted tensors: the
# pages of tensors no program uses (a T2V bundle's VAE encoder) stay out of the process's memory. Called through
# ctypes, which lets go of the GIL for the call: mmap.madvise holds it, and populating a 1.3B fp32 DiT's 5.7 GB
# takes 0.2-0.4 s during which the main thread (lowering, encoding the prompt) could not run Python at all.
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)
_libc_madvise = None
if _POPULATE_READ is not None:
    try:
        _libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
        _libc_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc_madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # no C library to call: the first program faults the pages in instead
        _libc_madvise = None


def _populate(base: int, start: int, end: int) -> None:
    """Populate bytes [start, end) of the mapping at address `base` (best effort: an older kernel refuses, and
    the first program that reads them faults them in instead)."""
    if _libc_madvise is None or end <= start:
        return
    start -= start % mmap.PAGESIZE
    _libc_madvise(base + start, end - start, _POPULATE_READ)


def _runs(entries: list[Entry], wanted: Any) -> list[list[Entry]]:
    """`entries` (in file order) that are in `wanted`, grouped into runs that lie back to back in the file: one
    populate call per run instead of per tensor."""
    runs: list[list[Entry]] = []
    for e in entries:
        if e.name not in wanted:
            continue
        if runs and runs[-1][-1].end == e.start:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def host_tensor(data: memoryview, e: Entry) -> np.ndarray:
    """Tensor `e` of a mapped file: a view of the mapping where it starts on an ALIGN-byte boundary (jax on CPU
    then adopts it as it is), else an aligned copy."""
    raw = np.frombuffer(data, np.uint8, e.end - e.start, e.start)
    if raw.ctypes.data % ALIGN:
        buf = aligned_empty(len(raw))
        buf[...] = raw
        raw = buf
    return raw.view(e.dtype).reshape(e.shape)


def place(host: np.ndarray, sharding: Any) -> jax.Array:
    """A global array from a host tensor: each addressable shard cut from it (unsharded on one device: the
    buffer itself, when it is aligned)."""
    if len(sharding.addressable_devices) == 1 and sharding.is_fully_replicated and jax.process_count() == 1:
        return jax.device_put(host, sharding)  # keeps the sharding: the compiled programs' cache keys use it
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class Source:
    """A loaded weight file's unmodified tensors, to place again (runtime/bundle.py Bundle.set_loras: a LoRA switch
    merges from these, never from merged weights). It keeps the file's read-only mapping (load_file fills it in): the
    unmodified copy is the kernel's page cache of the file, checked by sha256 when it was loaded, shared with every
    process mapping it, and costs no memory of this process's own; on CPU a placed tensor is that mapping itself."""

    def __init__(self, shardings: dict[str, Any]) -> None:
        self.shardings = shardings
        self.data: memoryview | None = None
        self.entries: dict[str, Entry] = {}

    def place(self, names: Any) -> dict[str, jax.Array]:
        """Tensors `names` placed as load_file placed them (the same bytes, the same shardings)."""
        return {n: place(host_tensor(self.data, self.entries[n]), self.shardings[n]) for n in names}


def load_file(path: Path, ref: mf.FileRef, checker: Checker | None, shardings: dict[str, Any],
              expected: dict[str, tuple[tuple[int, ...], np.dtype]],
              check: Callable[[str, Entry | None], str | None], source: Source | None = None) -> dict[str, jax.Array]:
    """The tensors named in `expected` from the weight file `ref`, placed with `shardings`.

    `check(name, entry)` says why a tensor is not what the programs expect (None: it is); it runs
    on the header, before any data is read. With a `checker`, the file is hashed while it is read
    unless its verified stamp still holds, and refused if the hash does not match. A `source` is given the
    mapping and the header, to place tensors from again later.
    """
    label = ref.file
    out: dict[str, jax.Array] = {}
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        started = checker.begin(ref, f) if checker is not None else None
        h = started[0] if started is not None else None
        try:
            entries = read_header(f, size, label)
            by_name = {e.name: e for e in entries}
            for name in expected:
                problem = check(name, by_name.get(name))
                if problem:
                    raise BundleError(problem)
        except BundleError:
            # An unchecked file that is not what the programs expect: say it was tampered with if it was.
            if started is not None:
                f.seek(0)
                if sha256_stream(f).hexdigest() != ref.sha256:
                    raise BundleError(mismatch_message(ref)) from None
            raise
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        data = memoryview(mapped)
        if h is not None:  # the whole file through the mapping (no copy); the tensors are then placed from the
            h.update(data)  # pages the hash brought in
        base = np.frombuffer(data, np.uint8).ctypes.data
        for run in _runs(entries, expected):
            _populate(base, run[0].start, run[-1].end)
            for e in run:
                out[e.name] = place(host_tensor(data, e), shardings[e.name])
        if checker is not None:
            checker.finish(ref, f, started)
        if source is not None:  # after the check: only a file that matched is placed from again
            source.data, source.entries = data, {e.name: e for e in entries if e.name in expected}
    return out
