"""The worker: one thread that claims queued jobs and runs them on the devices, one at a time (the accelerator is
the bottleneck), under a heartbeated lease; and the loader that makes the bundle ready first."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UserError
from .jobs import Job, JobStore, Lost
from .lease import Lease
from .state import State

log = logging.getLogger("runtime")


def run_job(pipe: Any, params: dict[str, Any], image_bytes: list[bytes], video: Path | None,
            on_progress: Callable[[int], None] = lambda p: None,
            on_step_time: Callable[[float], None] = lambda s: None,
            on_stage: Callable[[str], None] = lambda stage: None,
            on_lora: Callable[[dict[str, Any] | None], None] = lambda switched: None) -> None:
    """Generate one job's video (every process of a multi-host job runs this; only process 0 writes).
    `on_progress` follows the denoising steps, `on_stage` each finished stage ("encode", "denoise", "decode"),
    `on_lora` the job's LoRA set taken up (what the switch did, or None where the weights held it already)."""
    from ..magcache import MagCache
    from ..video import write_video
    from .loras import specs

    # the server's own --lora adapters, then the job's: switched to only where the weights hold another set
    on_lora(pipe.use_loras([*pipe.base_loras, *specs(params.get("lora"))]))
    media = media_of(params, image_bytes)
    s = pipe.settings(params["seed"], params["steps"], params["guidance"], params["flow_shift"], params["guidance_2"],
                      params.get("sampler"), params.get("sigmas"))
    magcache = MagCache(**params["magcache"]) if params.get("magcache") else None
    last = [time.perf_counter()]

    def steps_done(done: int, total: int) -> None:
        now = time.perf_counter()
        on_step_time(now - last[0])
        last[0] = now
        on_progress(min(99, int(100 * done / total)))

    if pipe.kind.forcing:  # any length, in overlapping segments: runtime/forcing.py
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"),
                               last_image=media.get("last_image"), num_frames=params["frames"],
                               overlap_history=params.get("overlap_history"), ar_step=params.get("ar_step") or 0,
                               causal_block_size=params.get("causal_block_size"),
                               addnoise_condition=params.get("addnoise_condition") or 0, fps=params["fps"],
                               seed=s.seed, steps=s.steps, guidance=s.guidance, flow_shift=s.flow_shift,
                               sampler=s.sampler, sigmas=s.sigmas, progress=False, size=params.get("size"),
                               on_step=steps_done)
        on_stage("decode")
        if video is not None:
            write_video(frames[0], video, fps=params["fps"])
        return
    if pipe.kind.animate:  # every segment: runtime/animate.py
        frames = pipe.generate(params["prompt"], params["negative_prompt"], image=media.get("image"),
                               pose_video=media.get("pose_video"), face_video=media.get("face_video"),
                               mode=params.get("mode") or "animate", background_video=media.get("background_video"),
                               mask_video=media.get("mask_video"),
                               prev_segment_frames=params.get("prev_segment_frames") or 1, seed=s.seed, steps=s.steps,
                               guidance=s.guidance, flow_shift=s.flow_shift, sampler=s.sampler, sigmas=s.sigmas,
                               progress=False, magcache=magcache, size=params.get("size"), frames=params.get("frames"),
                               on_step=steps_done)
        on_stage("decode")
        if video is not None:
            write_video(frames[0], video, fps=params["fps"])
        return
    run = {"conditioning_scale": params.get("conditioning_scale"),
           "strength": params.get("strength") if media.get("video") is not None and pipe.manifest.video_to_video
           else None}
    # Jobs queued before bundles had several shapes carry their size but no frames: the default shape's.
    shape = {"size": params.get("size"), "frames": params.get("frames")}
    embeds = pipe.encode(params["prompt"], params["negative_prompt"], media.get("image"), media.get("last_image"),
                         **shape, **{k: media[k] for k in ("video", "mask", "reference_images") if k in media})
    on_stage("encode")
    steps = pipe.steps_run(embeds, s, run["strength"])  # what progress counts: video-to-video runs the last ones
    last[0] = time.perf_counter()
    latents = pipe.denoise(embeds, s.seed, s.steps, s.guidance, s.flow_shift, progress=False,
                           on_step=lambda i: steps_done(i + 1, steps),
                           guidance_2=s.guidance_2, magcache=magcache, sampler=s.sampler, sigmas=s.sigmas,
                           **{k: v for k, v in run.items() if v is not None}, **shape)
    on_stage("denoise")
    frames = pipe.decode(latents)
    on_stage("decode")
    if video is not None:
        write_video(frames[0], video, fps=params["fps"])


def media_of(params: dict[str, Any], files: list[bytes]) -> dict[str, Any]:
    """A job's files by what they are in the run (params["media"] names them in order, schema.MEDIA_ROLES): `image`
    and `last_image` (PIL images), `video` and `mask` (PIL frames), `reference_images` (a list). Jobs queued before
    videos name none: their files are the first image, then the last."""
    from PIL import Image

    from .schema import VIDEO_ROLES, read_video_bytes

    roles = params.get("media") or ["image", "last_image"][: len(files)]
    out: dict[str, Any] = {}
    for role, data in zip(roles, files, strict=True):
        if role in VIDEO_ROLES:
            out[role] = read_video_bytes(data, role)
        elif role == "reference_image":
            out.setdefault("reference_images", []).append(Image.open(io.BytesIO(data)))
        else:
            out[role] = Image.open(io.BytesIO(data))
    return out


def worker(state: State) -> None:
    """Run queued jobs one at a time until draining; every failure is recorded on its job."""
    store = state.store
    while not state.draining.is_set():
        try:  # with adapters offered, preferring a job of the set the weights hold (jobs.py, loras.py)
            job = store.claim(state.lora_key if state.settings.loras else None, state.settings.lora_affinity_max)
        except Exception as e:  # noqa: BLE001  (the database is away for a moment: try again, stay up)
            log.warning("cannot claim a job: %s: %s", type(e).__name__, e)
            job = None
        if job is None:
            state.idle.set()
            if state.broadcast is not None:
                state.broadcast(None)  # a heartbeat keeps the other processes' collectives from timing out
            state.wake.wait(timeout=1.0)
            state.wake.clear()
            continue
        state.idle.clear()
        _run(state, job)
    state.idle.set()


def _run(state: State, job: Job) -> None:
    """Run a claimed job under its lease, then record the outcome, fenced: a replica that lost the job (its lease
    ran out while it was stopped or cut off, and another replica took it over) records nothing. The outcome is
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
    with Lease(lambda: store.heartbeat(job), store.lease, state.settings.stall, state.on_stall) as lease:

        def progress(p: int) -> None:
            lease.progress()
            if not lease.lost:
                try:
                    store.set_progress(job, p)
                except Lost:  # keep running: the other processes of a slice are in the same program
                    lease.lost = True

        try:
            images = [store.storage.read(key) for key in job.images]
            if state.broadcast is not None:
                state.broadcast({"params": job.params, "images": images})
            key = store.video_key(job)
            with store.storage.writer(key, ".mp4") as video:
                run_job(state.pipe, job.params, images, video, on_progress=progress,
                        on_step_time=m.step_seconds.observe if m else (lambda s: None),
                        on_stage=lambda stage: lease.progress(), on_lora=lora_taken)
        except UserError as e:
            failure = ("generation_failed", str(e))
            log.warning("job %s: failed: %s", job.id, e)
        except Exception as e:  # noqa: BLE001  (the job fails, the server lives on)
            log.exception("job %s: internal error", job.id)
            failure = ("internal_error", f"{type(e).__name__}: {e}")
    if failure is not None:
        outcome = _fail(store, job, *failure)
    else:
        try:
            store.complete(job, key)
            outcome = "completed"
            log.info("job %s: completed in %.1f s", job.id, time.perf_counter() - t0)
        except Lost:
            outcome = "lost"
            log.warning("job %s: taken over by another replica while this one ran it; its result is dropped", job.id)
    took = time.perf_counter() - t0
    state.job_seconds[:] = [*state.job_seconds[-9:], took]
    if m:
        m.job_seconds.observe(took)
        m.replica_jobs.labels(outcome).inc()


def _fail(store: JobStore, job: Job, code: str, message: str) -> str:
    try:
        store.fail(job, code, message)
        return "failed"
    except Lost:
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

