"""JAX's persistent compilation cache, so that the second start of a bundle skips XLA compilation.

The cache key covers the program, jax/jaxlib (and libtpu) versions, XLA flags and the device
topology, so one directory serves any number of bundles and machines of one kind. JAX trusts
what it finds there (entries are executables), so the default is a private per-user directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

log = logging.getLogger("runtime")

ENV = "WAN_AOT_CACHE_DIR"


def default_dir() -> Path:
    """$WAN_AOT_CACHE_DIR, else $XDG_CACHE_HOME/wan-aot/jax, else ~/.cache/wan-aot/jax."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "wan-aot" / "jax"


def enable(directory: str | os.PathLike | None = None) -> Path | None:
    """Cache every compiled program in `directory` (default: `default_dir()`, or a directory the user
    already gave jax); call before the first compilation. Returns the directory, or None if unusable
    (the run goes on, compiling as usual)."""
    configured = jax.config.jax_compilation_cache_dir
    path = Path(directory).expanduser() if directory is not None else Path(configured or default_dir())
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        log.warning("compilation cache disabled (%s): pass --cache-dir DIR or set %s", e, ENV)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache everything: a program that compiles in 0.5 s here may take a minute on a TPU slice.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path
