"""A running job's lease: heartbeat it while it makes progress, and give up when it stalls.

The worker calls `progress()` after every denoising step and every finished stage. A thread heartbeats the
job every `interval` seconds, but only while the last progress is at most `stall` seconds old: a job that
stalls (a multi-host collective waiting on a dead host, a hung device) stops being heartbeated, so after the
lease another replica takes it over, and `on_stall` runs (the server exits non-zero so that its supervisor
restarts it). A heartbeat that finds the job no longer ours (taken over while this replica was stopped or cut
off) marks the lease `lost`: the worker then records nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("runtime")

DEFAULT_STALL_S = 600.0  # the longest a job may go without a finished step or stage (a 720p VAE decode fits)


def heartbeat_interval(lease: float) -> float:
    """A few heartbeats per lease, so that one slow database write does not lose it."""
    return max(0.2, min(10.0, lease / 4))


class Lease:
    def __init__(self, heartbeat: Callable[[], bool], lease: float, stall: float,
                 on_stall: Callable[[], Any]) -> None:
        self._heartbeat, self.stall, self._on_stall = heartbeat, stall, on_stall
        self.interval = heartbeat_interval(lease)
        self.lost = False
        self.stalled = False
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wan-aot-lease", daemon=True)

    def __enter__(self) -> Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join(timeout=self.interval + 5)

    def progress(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        failing = False
        while not self._done.wait(self.interval):
            if time.monotonic() - self._last > self.stall:
                self.stalled = True
                log.error("the running job made no progress for %.0f s (--stall): no more heartbeats", self.stall)
                self._on_stall()
                return
            try:
                if not self._heartbeat() and not self._done.is_set():  # (ended meanwhile: nothing was lost)
                    self.lost = True
                    log.warning("the running job is no longer this replica's: a client cancelled or deleted it, or "
                                "(its lease having run out) another replica took it over")
                    return
                failing = False
            except Exception as e:  # noqa: BLE001  (the database is away: the lease may run out, keep trying)
                if not failing:  # once per outage, not once per heartbeat
                    log.warning("heartbeat failed: %s; trying again every %.1f s", e, self.interval)
                failing = True
