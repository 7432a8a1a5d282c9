"""Jobs across the processes of a multi-host slice: process 0 owns the queue and broadcasts each job.

Every process must run the same programs in the same order (they are one SPMD
computation), so process 0 sends each job's settings and images to the others with
`jax.experimental.multihost_utils.broadcast_one_to_all` before running it. While idle
it sends an empty heartbeat about once a second, so the others' waiting collective
never times out, and a stop message when it exits. Payloads are padded to a few
bucket sizes so the broadcast compiles a handful of programs, not one per job.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import numpy as np

from .run import Cancelled, run_job

log = logging.getLogger("runtime")

_MIN_BUCKET = 4096


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (others pass None)."""
    from jax.experimental import multihost_utils

    n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array([len(data or b"")], np.int32)))[0])
    if n == 0:
        return b""
    size = max(_MIN_BUCKET, 1 << (n - 1).bit_length())
    buf = np.zeros(size, np.uint8)
    if data:
        buf[:n] = np.frombuffer(data, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n])


def send(message: dict[str, Any] | None) -> None:
    """Process 0: a job ({"params", "images"}), a heartbeat (None) or {"stop": True}."""
    if message is None:
        _broadcast_bytes(b"")
        return
    wire = {**message, "images": [base64.b64encode(b).decode() for b in message.get("images", [])]}
    _broadcast_bytes(json.dumps(wire).encode())


def agree(stop: bool | None) -> bool:
    """Process 0's `stop` on every process (the others pass None): whether the running job stops here (a client
    cancelled it). Asked at every step and stage boundary, by every process at the same one (run.run_job's
    `check`)."""
    from jax.experimental import multihost_utils

    flag = np.array([1 if stop else 0], np.int32)
    return bool(np.asarray(multihost_utils.broadcast_one_to_all(flag))[0])


def follow(pipe: Any) -> int:
    """Processes 1..N-1: run every job process 0 sends, until it says stop."""

    def check() -> None:
        if agree(None):
            raise Cancelled

    log.info("following process 0's jobs")
    while True:
        data = _broadcast_bytes(None)
        if not data:
            continue
        message = json.loads(data)
        if message.get("stop"):
            log.info("process 0 stopped; exiting")
            return 0
        images = [base64.b64decode(b) for b in message["images"]]
        try:  # with a preview consumer as process 0 has: its previews read global arrays, every process takes part
            run_job(pipe, message["params"], images, None, on_preview=lambda rgb: None, check=check)
        except Cancelled:
            log.info("the job was cancelled; stopped with process 0")
        except Exception:  # noqa: BLE001  (process 0 records the failure; stay in step with it)
            log.exception("job failed on this process")
