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

import io
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import helios, hls
from ..errors import UserError
from ..files import disk_full
from . import derive, images, thumbnails
from .db import DatabaseUnavailable
from .jobs import Job, JobStore, Lost, derived_keys
from .lease import Lease
from .state import State
from .storage import StorageUnavailable

log = logging.getLogger("runtime")
# A running job's progress and stage writes that fail are skipped, not the job's failure: the database away, or
# SQLite's disk full (the job's end is what must be recorded, and is retried: _patiently, the lease).
_SKIPPED = (DatabaseUnavailable, sqlite3.OperationalError)


class Cancelled(Exception):
    """A client cancelled or deleted the running job: the run stops at the boundary it reached and stores nothing."""


def run_job(pipe: Any, params: dict[str, Any], image_bytes: list[bytes], video: Path | None,
            on_progress: Callable[[int], None] = lambda p: None,
            on_step_time: Callable[[float], None] = lambda s: None,
            on_stage: Callable[[str], None] = lambda stage: None,
            on_preview: Callable[[Any], None] = lambda rgb: None,
            check: Callable[[], None] = lambda: None,
            on_lora: Callable[[dict[str, Any] | None], None] = lambda switched: None,
            on_frames: Callable[[Any], None] = lambda frames: None) -> Any:
    """Generate one job's video (every process of a multi-host job runs this, with the same callbacks called at the
    same points; only process 0 writes) and return its frames (F, H, W, 3) in [0, 1]. `on_progress` follows the
    denoising steps, `on_stage` each finished stage ("encode", "denoise", "decode"), `on_preview` gets each step's
    estimate of the middle frame (Pipeline.denoise); `check` runs after every step and stage and raises to stop;
    `on_lora` gets the job's LoRA set taken up (what the switch did, or None where the weights held it already);
    `on_frames` the video's frames in order, as they are final ((F, H, W, 3) or (1, F, H, W, 3) each: a segment
    loop's each segment's, as it is decoded; the one-shape kinds' whole video at the end), which join into the video
    returned."""
    from ..magcache import MagCache
    from ..video import write_video
    from .loras import specs

    # the server's own --lora adapters, then the job's: switched to only where the weights hold another set
    on_lora(pipe.use_loras([*pipe.base_loras, *specs(params.get("lora"))]))
    media = derive.sources(params, media_of(params, image_bytes))
    s = pipe.settings(params["seed"], params["steps"], params["guidance"], params["flow_shift"], params["guidance_2"],
                      params.get("sampler"), params.get("sigmas"))
    magcache = MagCache(**params["magcache"]) if params.get("magcache") else None
    last = [time.perf_counter()]

    def steps_done(done: int, total: int) -> None:
        now = time.perf_counter()
        on_step_time(now - last[0])
        last[0] = now
        on_progress(min(99, int(100 * done / total)))
        check()

    def stage_done(stage: str) -> None:
        on_stage(stage)
        check()

    if params.get("task") == images.TASK:  # POST /v1/images/edits: pipe.edit_image, its PNG (runtime/serve/images.py)
        return images.run_edit(pipe, params, media, s, magcache, steps_done, stage_done, on_preview, check, video)
    if pipe.kind.forcing:  # any length, in overlapping segments: runtime/forcing.py
        source = media.pop("_source", None)  # an extension's (derive.py's "forcing" way): the video continued
        live = on_frames if source is None else derive.forcing_live(params, len(source), on_frames)
        check()
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"),
                               last_image=media.get("last_image"), video=source, num_frames=params["frames"],
                               overlap_history=params.get("overlap_history"), ar_step=params.get("ar_step") or 0,
                               causal_block_size=params.get("causal_block_size"),
                               addnoise_condition=params.get("addnoise_condition") or 0, fps=params["fps"],
                               seed=s.seed, steps=s.steps, guidance=s.guidance, flow_shift=s.flow_shift,
                               sampler=s.sampler, sigmas=s.sigmas, progress=False, size=params.get("size"),
                               on_step=steps_done, on_preview=on_preview,
                               decoder=params.get("decoder") or "full", on_frames=live)[0]
        if source is not None:  # the source, then the new part after the frames it re-decodes (those shared)
            frames = derive.forcing_joined(params, len(source), frames)
        stage_done("decode")
        if video is not None:
            write_video(frames, video, fps=params["fps"])
        return frames
    if pipe.kind.helios:  # any length, in chunks: runtime/helios.py
        source = media.get("_source")  # an extension's (derive.py's "helios" way): the video continued
        if source is not None:  # the stream shows the video the job writes: the source, then the new chunks
            on_frames(derive.joined(params, dict(media), np.zeros((0, *_frame_shape(pipe, params)), np.float32))[None])
        check()
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"), video=source,
                               num_frames=params["frames"], seed=s.seed, steps=s.steps, guidance=s.guidance,
                               sampler=params.get("sampler"), sigmas=s.sigmas, progress=False,
                               size=params.get("size"), on_step=steps_done, on_preview=on_preview,
                               decoder=params.get("decoder") or "full", on_frames=on_frames,
                               **{name: params.get(name) for name in helios.SETTINGS})[0]
        frames = derive.joined(params, media, frames)  # an extension's source first
        stage_done("decode")
        if video is not None:
            write_video(frames, video, fps=params["fps"])
        return frames
    if pipe.kind.animate:  # every segment: runtime/animate.py
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"),
                               pose_video=media.get("pose_video"), face_video=media.get("face_video"),
                               mode=params.get("mode") or "animate", background_video=media.get("background_video"),
                               mask_video=media.get("mask_video"),
                               prev_segment_frames=params.get("prev_segment_frames") or 1, seed=s.seed, steps=s.steps,
                               guidance=s.guidance, flow_shift=s.flow_shift, sampler=s.sampler, sigmas=s.sigmas,
                               progress=False, magcache=magcache, size=params.get("size"), frames=params.get("frames"),
                               on_step=steps_done, on_preview=on_preview,
                               decoder=params.get("decoder") or "full", on_frames=on_frames)
        stage_done("decode")
        if video is not None:
            write_video(frames[0], video, fps=params["fps"])
        return frames[0]
    remake = media.pop("remake", None)  # remix and edits: the source video, noised (derive.py)
    run = {"conditioning_scale": params.get("conditioning_scale"),
           "strength": params.get("strength") if (media.get("video") is not None and pipe.manifest.video_to_video)
           or remake is not None else None}
    # Jobs queued before bundles had several shapes carry their size but no frames: the default shape's.
    shape = {"size": params.get("size"), "frames": params.get("frames")}
    check()
    embeds = pipe.encode(params["prompt"], params["negative_prompt"], media.get("image"), media.get("last_image"),
                         **shape, **{k: media[k] for k in ("video", "mask", "reference_images") if k in media})
    if remake is not None:
        embeds["video_latents"] = derive.video_latents(pipe, remake, shape["size"], shape["frames"])
    stage_done("encode")
    steps = pipe.steps_run(embeds, s, run["strength"])  # what progress counts: video-to-video runs the last ones
    last[0] = time.perf_counter()
    latents = pipe.denoise(embeds, s.seed, s.steps, s.guidance, s.flow_shift, progress=False,
                           on_step=lambda i: steps_done(i + 1, steps), on_preview=on_preview,
                           guidance_2=s.guidance_2, magcache=magcache, sampler=s.sampler, sigmas=s.sigmas,
                           **{k: v for k, v in run.items() if v is not None}, **shape)
    stage_done("denoise")
    # extensions: the source, then the new frames
    frames = derive.joined(params, media, pipe.decode(latents, params.get("decoder") or "full")[0])
    on_frames(frames)
    stage_done("decode")
    if video is not None:
        write_video(frames, video, fps=params["fps"])
    return frames


def _frame_shape(pipe: Any, params: dict[str, Any]) -> tuple[int, int, int]:
    """(H, W, 3): the frames of a job at its size."""
    g = pipe.shape(params.get("size"))
    return (g.height, g.width, 3)


def media_of(params: dict[str, Any], files: list[bytes]) -> dict[str, Any]:
    """A job's files by what they are in the run (params["media"] names them in order, schema.MEDIA_ROLES): `image`
    and `last_image` (PIL images), `video` and `mask` (PIL frames), `reference_images` (a list); a derived job's
    source video (derive.SOURCE_ROLES, PIL frames). Jobs queued before videos name none: their files are the first
    image, then the last."""
    from PIL import Image

    from .schema import VIDEO_ROLES, read_video_bytes

    roles = params.get("media") or ["image", "last_image"][: len(files)]
    out: dict[str, Any] = {}
    for role, data in zip(roles, files, strict=True):
        if role in VIDEO_ROLES or role in derive.SOURCE_ROLES:
            out[role] = read_video_bytes(data, role)
        elif role == "reference_image":
            out.setdefault("reference_images", []).append(Image.open(io.BytesIO(data)))
        else:
            out[role] = Image.open(io.BytesIO(data))
    return out


def worker(state: State) -> None:
    """Run queued jobs one at a time until draining; every failure is recorded on its job."""
    store = state.store
    failing = False  # claims fail (a full disk under SQLite, say): said once, and once when they work again
    while not state.draining.is_set():
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
    agree = _agree if state.broadcast is not None else None  # a multi-host slice stops as one
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


def _agree(stop: bool) -> bool:
    from .follower import agree

    return agree(stop)


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

