"""wan-aot runtime: run exported Wan bundles with jax, numpy, safetensors and tokenizers (no torch).

    import runtime
    pipe = runtime.load("artifacts/tiny")
    frames = pipe.generate("a cat playing piano", seed=0, steps=20)
    runtime.write_video(frames[0], "cat.mp4", fps=16)

`runtime.enable_compilation_cache()` (before the first call) makes the next process skip compiling.
"""

from .cache import enable as enable_compilation_cache
from .errors import BundleError, UserError
from .pipeline import Pipeline, load
from .video import write_video

__all__ = ["BundleError", "Pipeline", "UserError", "enable_compilation_cache", "load", "write_video"]
