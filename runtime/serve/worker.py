"""The worker: one thread that claims queued jobs and runs them on the devices, one at a time (the accelerator is
the bottleneck), under a heartbeated lease; and the loader that makes the bundle ready first.

While a job runs, every denoising step writes its progress (fenced, runtime/serve/jobs.py) and hands the step's
preview to a writer thread (runtime/serve/thumbnails.py); every step and stage boundary asks whether a client has
cancelled or deleted the job, and if so the run stops there (`Cancelled`), storing nothing, and the worker takes the
next job. On a multi-host slice process 0 decides and every process learns it at the same boundary (follower.agree).
A completed job also gets its thumbnail and spritesheet, made from the frames in memory.

The job database may go away while a job runs (PostgreSQL restarting): progress and stage writes are skipped while it
is (the lease's heartbeats fail, and the job is taken over if the outage outlasts the lease), and the outcome is
written once it is back, waited for up to --queue-wait; fenced, so a job taken over meanwhile is not completed twice.
An object store that fails past --store-retry-seconds fails the job with storage_unavailable; its frames are not
kept (a retry denoises again)."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from .. import hls
from ..errors import UserError
from ..files import disk_full
from . import follower, thumbnails
from .db import DatabaseUnavailable
from .jobs import Job, JobStore, Lost, derived_keys
from .lease import Lease
from .run import Cancelled, run_job
from .state import State
from .storage import StorageUnavailable

log = logging.getLogger("runtime")
# A running job's progress and stage writes that fail are skipped, not the job's failure: the database away, or
# SQLite's disk full (the job's end is what must be recorded, and is retried: _patiently, the lease).
_SKIPPED = (DatabaseUnavailable, sqlite3.OperationalError)


def worker(state: State) -> None:
    """Run queued jobs one at a time until draining; every failure is recorded on its job."""
    store = state.store
    failing = False  # claims fail (a full disk under SQLite, say): said once, and once when they work again
    while not state.draining.is_set():
        if not state.slot.acquire(timeout=1.0):  # a realtime session runs on the devices (realtime.py)
            continue
        try:  # with adapters offered, preferring a job of the set the weights hold (jobs.py, loras.py)
            job = store.claim(state.lora_key if state.settings.loras else None, state.settings.lora_affinity_max)
            if failing:
                log.warning("claims work again")
            failing = False
        except DatabaseUnavailable:  # said once by the database layer, and again when it is back
            job = None
        except Exception as e:  # noqa: BLE001  (the database is away for a moment: try again, stay up)
            if not failing:
                log.warning("cannot claim a job: %s: %s; trying again every second", type(e).__name__, e)
            failing, job = True, None
        if job is None:
            state.slot.release()
            state.idle.set()
            if state.broadcast is not None:
                state.broadcast(None)  # a heartbeat keeps the other processes' collectives from timing out
            state.wake.wait(timeout=1.0)
            state.wake.clear()
            continue
        state.idle.clear()
        try:
            _run(state, job)
        except Exception as e:  # noqa: BLE001  (recording the outcome failed: the database or storage is away)
            # The worker lives on: the job's lease, no longer heartbeated, runs out and a claim takes it up again.
            log.error("job %s: its outcome could not be recorded (%s: %s); it is retried once its lease runs out",
                      job.id, type(e).__name__, e)
        finally:
            state.slot.release()
    state.idle.set()


def _run(state: State, job: Job) -> None:
    """Run a claimed job under its lease, then record the outcome, fenced: a replica that lost the job (its lease
    ran out while it was stopped or cut off, and another replica took it over) records nothing, nor does one whose job
    a client cancelled or deleted (it stops at the next step or stage boundary instead of finishing). The outcome is
    recorded after the lease has ended (no heartbeat in flight): a heartbeat landing after the job is completed or
    failed finds it no longer in progress and would read as a takeover."""
    store, m = state.store, state.metrics
    log.info("job %s: started (attempt %d)", job.id, job.attempts)

    def lora_taken(switched: dict[str, Any] | None) -> None:
        from .loras import set_key

        state.lora_key = set_key(job.params.get("lora"))
        if switched is not None:
            log.info("job %s: LoRA set %s, switched to in %.3f s (%d tensors merged again)", job.id, switched["set"],
                     switched["seconds"], switched["tensors"])
            if m:
                m.lora_switches.inc()
                m.lora_switch_seconds.observe(switched["seconds"])

    t0 = time.perf_counter()
    failure: tuple[str, str] | None = None
    cancelled = False
    stop: list[bool | None] = [None]  # whether a client cancelled the job: None until a refused write asks
    steps = [0]
    agree = follower.agree if state.broadcast is not None else None  # a multi-host slice stops as one
    writer = thumbnails.PreviewWriter(store.storage, store.preview_key(job))
    stream: hls.HlsWriter | None = None
    key = store.video_key(job)
    with Lease(lambda: store.heartbeat(job), store.lease, state.settings.stall, state.on_stall) as lease:

        def refused() -> None:
            """A fenced write found the job no longer ours: a client cancelled or deleted it, or (its lease having
            run out) another replica took it over, in which case the run goes on (the other processes of a slice are
            in the same program) and its result is dropped."""
            if stop[0] is None:
                try:
                    stop[0] = store.cancelled(job)
                except DatabaseUnavailable:  # asked again at the next refusal
                    return
            if not stop[0]:
                lease.lost = True

        def progress(p: int) -> None:
            lease.progress()
            if not lease.lost and not stop[0]:
                try:
                    store.set_progress(job, p)
                except Lost:
                    refused()
                except _SKIPPED:  # the next step's progress says it
                    pass

        def stage(name: str) -> None:
            lease.progress()
            if not lease.lost and not stop[0]:
                try:
                    if not store.heartbeat(job):
                        refused()
                except _SKIPPED:
                    pass

        def check() -> None:
            if lease.lost and stop[0] is None:  # the lease's heartbeat was refused first: why?
                refused()
            flag = bool(stop[0])
            if agree is not None:
                flag = agree(flag)
            if flag:
                raise Cancelled

        def step_time(seconds: float) -> None:
            steps[0] += 1
            if m:
                m.step_seconds.observe(seconds)

        try:
            if _patiently(state, lambda: store.cancelled(job)):  # deleted or cancelled since the claim
                raise Cancelled
            images = [store.storage.read(key, wait=True) for key in job.images]
            if state.broadcast is not None:
                state.broadcast({"params": job.params, "images": images})
            stream = _stream(store, job)
            with store.storage.writer(key, "." + key.rsplit(".", 1)[1]) as video:  # an mp4, or an edit's png
                frames = run_job(state.pipe, job.params, images, video, on_progress=progress, on_step_time=step_time,
                                 on_stage=stage, on_preview=writer.offer, check=check, on_lora=lora_taken,
                                 on_frames=stream.add)
            also = derived_keys(key)
            for derived, data in zip(also, thumbnails.derive(frames), strict=True):
                store.storage.put(derived, data)
        except Cancelled:
            cancelled = True
        except UserError as e:
            failure = ("generation_failed", str(e))
            log.warning("job %s: failed: %s", job.id, e)
        except Exception as e:  # noqa: BLE001  (the job fails, the server lives on)
            if disk_full(e):  # the video storage is full: nothing was renamed into place (storage.py, video.py)
                failure = ("storage_full", "the video could not be stored: the video storage is full (no space left "
                                           "on device); submit the job again once space is freed")
                log.error("job %s: failed: the video storage is full: %s", job.id, e)
                if m:
                    m.storage_errors.labels("full").inc()
                store.discard(key, *derived_keys(key))
            elif isinstance(e, StorageUnavailable):  # the object store failed past --store-retry-seconds
                failure = ("storage_unavailable", f"the video could not be stored: {e}; submit the job again once "
                                                  "the store is back")
                log.error("job %s: failed: %s", job.id, e)
                if m:
                    m.storage_errors.labels("unavailable").inc()
            elif _patiently(state, lambda: store.cancelled(job)):  # its images went with it, say
                cancelled = True
            else:
                log.exception("job %s: internal error", job.id)
                failure = ("internal_error", f"{type(e).__name__}: {e}")
    writer.close()
    _end(stream)  # however it ended: a failed or cancelled job's stream ends where it stopped
    if cancelled:
        outcome = "cancelled"
        store.discard(store.preview_key(job))
        log.info("job %s: cancelled by a client; stopped after %d denoising steps, nothing stored", job.id, steps[0])
    elif failure is not None:
        outcome = _fail(state, job, *failure)
    else:
        try:
            _patiently(state, lambda: store.complete(job, key, also))
            outcome = "completed"
            log.info("job %s: completed in %.1f s", job.id, time.perf_counter() - t0)
        except Lost:
            if _patiently(state, lambda: store.cancelled(job)):  # while the video was written: nothing stays
                outcome = "cancelled"
                log.info("job %s: cancelled by a client as it ended; nothing stored", job.id)
            else:
                outcome = "lost"
                log.warning("job %s: taken over by another replica while this one ran it; its result is dropped",
                            job.id)
                store.discard(key, *derived_keys(key))  # this attempt's (the new owner's has its own names)
    state.wake_webhooks()  # its end's deliveries are due
    took = time.perf_counter() - t0
    state.job_seconds[:] = [*state.job_seconds[-9:], took]
    if m:
        m.job_seconds.observe(took)
        m.replica_jobs.labels(outcome).inc()


def _stream(store: JobStore, job: Job) -> hls.HlsWriter:
    """The attempt's live stream (runtime/hls.py), in the video storage beside its video: any replica serves it."""
    return hls.HlsWriter(lambda name, data: store.storage.put(store.stream_key(job, name), data), job.params["fps"])


def _end(stream: hls.HlsWriter | None) -> None:
    if stream is None:
        return
    try:
        stream.end()
    except Exception as e:  # noqa: BLE001  (the storage is away: the route ends a finished job's playlist itself)
        log.warning("cannot end the live stream's playlist: %s: %s", type(e).__name__, e)


def _patiently(state: State, fn: Callable[[], Any]) -> Any:
    """`fn()`, again with backoff while the job database is away, for up to --queue-wait seconds: a finished job's
    outcome outlives a database restart (then DatabaseUnavailable, and the lease running out retries the job)."""
    t0, delay = time.monotonic(), 0.5
    while True:
        try:
            return fn()
        except DatabaseUnavailable:
            if time.monotonic() - t0 + delay > state.settings.queue_wait:
                raise
            time.sleep(delay)  # short: once it is back, this replica's record races the others' takeover
            delay = min(1.0, delay * 2)


def _fail(state: State, job: Job, code: str, message: str) -> str:
    store = state.store
    try:
        _patiently(state, lambda: store.fail(job, code, message))
        return "failed"
    except Lost:
        if _patiently(state, lambda: store.cancelled(job)):
            return "cancelled"
        log.warning("job %s: taken over by another replica; its failure is not recorded", job.id)
        return "lost"


def load_and_compile(state: State, loader: Callable[[], Any]) -> None:
    """Load the bundle and compile every program; /ready answers 200 only after this."""
    try:
        t0 = time.perf_counter()
        pipe = loader()
        if state.settings.magcache is not None:  # every job would fail: refuse to become ready
            pipe.step_programs(1, [0], pipe.settings(steps=1), state.settings.magcache)
        pipe.prepare(magcache=state.settings.magcache is not None)
        state.pipe = pipe
        state.ready.set()
        log.info("ready: %s loaded and compiled in %.1f s", state.settings.bundle, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  (one line in the log; the server stops, see server.py)
        state.load_error = f"{type(e).__name__}: {e}"
        log.error("could not load %s: %s; stopping (no job could run)", state.settings.bundle, state.load_error)
        state.on_load_error()

