"""wan-aot runtime: run exported Wan bundles with jax, numpy, safetensors and tokenizers (no torch).

    import runtime
    pipe = runtime.load("artifacts/tiny")
    frames = pipe.generate("a cat playing piano", seed=0, steps=20)
    fast = pipe.generate("a cat playing piano", magcache=runtime.MagCache(ratios))  # ratios: `calibrate`
    runtime.write_video(frames[0], "cat.mp4", fps=16)

`runtime.enable_compilation_cache()` (before the first call) makes the next process skip compiling.

The jax-using names are imported on first use, so that the numpy-only modules (`runtime.scheduler`,
`runtime.magcache`, `runtime.text`, `runtime.video`, `runtime.intermediates`) serve clients without jax, such as
tools/tf_generate.py.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import BundleError, UserError
from .magcache import MagCache
from .platforms import keep_jax_off_absent_tpus
from .video import write_video

keep_jax_off_absent_tpus()  # before jax starts a backend: libtpu on a machine without a TPU stays quiet

_LAZY = {"Pipeline": ".pipeline", "load": ".pipeline", "enable_compilation_cache": ".cache"}
_NAMES = {"enable_compilation_cache": "enable"}

__all__ = ["BundleError", "MagCache", "Pipeline", "UserError", "enable_compilation_cache", "load", "write_video"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), _NAMES.get(name, name))
    globals()[name] = value
    return value
