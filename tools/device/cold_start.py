"""One cold start of a bundle (this fresh process, an empty compilation cache): ready, then a 4-step video; XLA's
compilations counted from jax's log. Standalone (numpy, jax and runtime only) for a machine without the benchmark's
imports; tools/benchmarks/precompiled.py's child is the same measurement here.

    python tools/device/cold_start.py BUNDLE CACHE_DIR FRAMES.npy    # prints one JSON line
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

START = time.time()


class _Count(logging.Handler):
    programs = others = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("Finished XLA compilation of jit(call)"):
            _Count.programs += 1
        elif text.startswith("Finished XLA compilation of "):
            _Count.others += 1


def main(bundle: str, cache: str, out: str) -> None:
    os.environ["WAN_AOT_STAMP_DIR"] = cache + "/stamps"
    import jax

    for name in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler"):
        logger = logging.getLogger(name)
        logger.addHandler(_Count())
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
    jax.config.update("jax_log_compiles", True)
    import numpy as np

    import runtime

    runtime.enable_compilation_cache(cache)
    pipe = runtime.load(bundle)
    pipe.prepare()
    ready = time.time() - START
    frames = pipe.generate("a lighthouse in a storm", seed=0, steps=4, progress=False)
    video = time.time() - START
    np.save(out, np.asarray(frames))
    loaded = sum(k.startswith("load executable ") for k in pipe.bundle.timings)
    print(json.dumps({"bundle": bundle, "ready": round(ready, 2), "video": round(video, 2),
                      "programs_compiled": _Count.programs, "other_compiled": _Count.others,
                      "executables_loaded": loaded}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
