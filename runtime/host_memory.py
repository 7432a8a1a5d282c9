"""Giving freed host memory back to the system between stages.

XLA's CPU buffers come from glibc's heap, which keeps freed pages for reuse: after denoising, the
cross-attention keys and values and the steps' buffers (0.7 GB at the 1.3B widths) stay resident while the
VAE decode allocates its own, and the decode becomes the run's peak resident memory beside the DiT's mapped
weights. Trimming the heap before the decode returns them. A no-op where the C library has no malloc_trim
(musl, macOS)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed() -> bool:
    """Return the heap's free pages to the system; whether anything was returned."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
