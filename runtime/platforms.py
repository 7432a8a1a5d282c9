"""Keep jax off a TPU backend that is not there.

With libtpu installed (the `tpu` extra, which `runtime fit` and the test set use) on a machine without a TPU, jax
still tries the TPU backend first when it starts, and libtpu prints its start-up errors to stderr in every process
(GCE metadata lookups, TPU_WORKER_HOSTNAMES, "could not determine TPU accelerator type"). A CLI whose errors are
one line, and a CPU server's logs, would start with a dozen lines of them. Where libtpu is installed but the PCI bus
has no TPU chip (jax's own test, hardware_utils) and no NVIDIA GPU is visible, this sets JAX_PLATFORMS=cpu before
jax starts a backend; an explicit JAX_PLATFORMS always wins. `runtime fit` does not need the TPU backend: it loads
libtpu's compiler on its own (runtime/fit.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys


def keep_jax_off_absent_tpus() -> bool:
    """Set JAX_PLATFORMS=cpu where libtpu is installed and no TPU is attached (see the module docstring); returns
    whether it did. Call before jax starts its backends (at `import runtime`)."""
    if "JAX_PLATFORMS" in os.environ:
        return False
    try:
        if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
            return False
    except (ImportError, ValueError):
        return False
    from jax._src import hardware_utils  # jax's own scan of the PCI bus (no backend is started)

    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    if chips or hardware_utils.has_visible_nvidia_gpu():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already (a backend not started yet reads the config, not the environment)
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True
