"""One process per host: joining the job, and moving arrays between host memory and the global mesh.

On a multi-host slice every process runs the same program on its own devices.
Host data (noise, embeddings, coefficients) is identical on every process and each
places only its addressable shards; results the programs return replicated are
read from a local shard, and anything else is gathered. Process 0 writes files.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from .errors import UserError

log = logging.getLogger("runtime")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, auto: bool = False) -> None:
    """Join a multi-process job if asked to: by arguments, by JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID, or (auto) by JAX's cluster auto-detection (TPU pods, SLURM, ...)."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given) and not auto:
        return
    if any(given) and not all(given) and not auto:
        raise UserError("--coordinator, --num-processes and --process-id go together (or use --distributed "
                        "to let JAX detect the cluster)")
    if num_processes is not None and process_id is not None and (
            num_processes < 1 or not 0 <= process_id < num_processes):
        raise UserError(f"--process-id {process_id} must be in [0, {num_processes}) and --num-processes >= 1")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"cannot join the multi-process job ({e}): check --coordinator HOST:PORT is reachable "
                        "and every process uses the same --num-processes") from None
    log.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} is not an integer") from None


def is_primary() -> bool:
    return jax.process_index() == 0


def put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from host data that every process holds in full (each places its own shards)."""
    if isinstance(x, jax.Array):
        return x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def fetch(x: jax.Array) -> np.ndarray:
    """The whole value of a global array on this host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
