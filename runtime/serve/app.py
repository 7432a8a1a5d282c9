"""`python -m runtime serve`: a bundle behind the OpenAI videos API, with a durable job queue.

    POST   /v1/videos              create a job (JSON or multipart form; `input_reference` = the image)
    GET    /v1/videos/{id}         the job (queued / in_progress / completed / failed, progress 0-100)
    GET    /v1/videos/{id}/content the mp4
    GET    /v1/videos              newest first (limit, after, order)
    GET    /v1/models              the bundle served and its shapes (size, frames, seconds)
    GET    /                       the playground page (runtime/serve/ui/; off with --no-ui)
    DELETE /v1/videos/{id}
    GET    /health  /ready  /metrics

One worker thread runs one job at a time on the devices (the accelerator is the
bottleneck). Jobs live in a database (runtime/serve/jobs.py: SQLite under the jobs
directory by default, or PostgreSQL with --queue, shared by every replica), videos and
images in shared storage (runtime/serve/storage.py), so any replica answers for any
job and a restart loses none. A replica claims a job under a lease that it heartbeats
while the job makes progress (runtime/serve/lease.py); a replica that dies or stalls
stops heartbeating and another takes the job over. SIGTERM drains: new jobs get 503,
the running job finishes, then the server exits (queued jobs stay queued for the other
replicas or the next start). With several processes (TPU slices), process 0 serves,
claims and heartbeats, and every job's settings and images are broadcast to the
others, which run the same programs (runtime/serve/follower.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .. import kinds
from ..errors import UserError
from .jobs import Job, JobStore, Lost, QueueFull, open_store
from .lease import DEFAULT_STALL_S, Lease

log = logging.getLogger("runtime")

MAX_BODY_BYTES = 32 << 20  # a request (form fields and images)
MAX_IMAGE_BYTES = 20 << 20  # one image file
MAX_IMAGE_PIXELS = 40_000_000  # one image, decoded
MAX_PROMPT_CHARS = 20_000
MAX_STEPS = 1000  # per job: more would hold the one worker for hours
POLL_AFTER_MS = 250  # what the openai SDK's poll helpers wait between retrieves


class ApiError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 409: "conflict",
                             413: "request_too_large", 429: "queue_full", 503: "unavailable"}.get(status, "error")

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(self.status, "invalid_request_error"
                                                                              if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Settings:
    bundle: Path
    api_key: str | None = None
    jobs_dir: Path = Path("jobs")
    queue_size: int = 16
    magcache: Any = None  # runtime.MagCache every job runs with (recorded in the job's params), or None
    queue: str | None = None  # the job database: None (SQLite under jobs_dir) or a postgresql:// URL
    videos_url: str | None = None  # videos and images in an object store instead of jobs_dir
    lease: float = 60.0  # seconds without a heartbeat after which another replica takes a job over
    stall: float = DEFAULT_STALL_S  # seconds without progress after which a replica gives its job up and exits
    ui: bool = True  # the playground page at GET / (runtime/serve/ui/)


@dataclass
class State:
    """What the HTTP handlers and the worker share."""

    settings: Settings
    store: JobStore
    pipe: Any = None  # runtime.Pipeline, once loaded and compiled
    ready: threading.Event = field(default_factory=threading.Event)
    draining: threading.Event = field(default_factory=threading.Event)
    idle: threading.Event = field(default_factory=threading.Event)  # set while the worker runs no job
    wake: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None
    metrics: Any = None
    job_seconds: list[float] = field(default_factory=list)  # the last few jobs' durations (for Retry-After)
    broadcast: Callable[[dict[str, Any] | None], None] | None = None  # multi-host: send a job to the others
    on_stall: Callable[[], Any] = lambda: os._exit(3)  # a stalled job: exit non-zero, the supervisor restarts us

    @property
    def model(self) -> str:
        return self.settings.bundle.resolve().name


# -- request parsing -----------------------------------------------------------
_FLOAT_FIELDS = ("guidance_scale", "guidance_scale_2", "flow_shift")
_INT_FIELDS = ("seed", "num_inference_steps", "fps")
_STR_FIELDS = ("prompt", "negative_prompt", "model", "size", "seconds")
_IMAGE_FIELDS = ("input_reference", "last_image")


def _number(name: str, value: Any, kind: type) -> Any:
    """A JSON number or a form field's text as `kind` (int or float); None when absent."""
    if value is None or value == "":
        return None
    what = "an integer" if kind is int else "a number"
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError
        number = int(value) if kind is int and isinstance(value, int) else float(value)
    except (ValueError, OverflowError):
        raise ApiError(400, f"{name} must be {what}, got {value!r}", name) from None
    if kind is int and isinstance(number, float):
        if not number.is_integer():
            raise ApiError(400, f"{name} must be {what}, got {value!r}", name)
        return int(number)
    return number


def parse_request(fields: dict[str, Any], images: dict[str, bytes], state: State) -> dict[str, Any]:
    """Validate a create request as the CLI would; returns the job's params. Raises ApiError(400) naming the
    field."""
    pipe = state.pipe
    g, kind = pipe.geometry, pipe.kind
    unknown = sorted(set(fields) - {*_FLOAT_FIELDS, *_INT_FIELDS, *_STR_FIELDS, *_IMAGE_FIELDS})
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}", unknown[0])
    for name in _STR_FIELDS:
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise ApiError(400, f"{name} must be a string", name)
    prompt = fields.get("prompt")
    if not prompt or not prompt.strip():
        raise ApiError(400, "prompt is required (a non-empty string)", "prompt")
    if len(prompt) > MAX_PROMPT_CHARS or len(fields.get("negative_prompt") or "") > MAX_PROMPT_CHARS:
        raise ApiError(400, f"prompt longer than {MAX_PROMPT_CHARS} characters", "prompt")
    model = fields.get("model")
    if model and model not in (state.model, pipe.bundle_id):
        raise ApiError(400, f"model {model!r} is not served here: this server runs {state.model!r}", "model")
    shapes = pipe.manifest.shapes
    sizes = list(dict.fromkeys(s.size for s in shapes))
    size = g.size
    if fields.get("size"):
        size = fields["size"].strip().lower()
        if size not in sizes:
            raise ApiError(400, f"size {fields['size']!r} is not one this bundle makes: it makes {', '.join(sizes)}",
                           "size")
    p: dict[str, Any] = {name: _number(name, fields.get(name), float) for name in _FLOAT_FIELDS}
    p.update({name: _number(name, fields.get(name), int) for name in _INT_FIELDS})
    fps = p["fps"] if p["fps"] is not None else pipe.manifest.defaults.fps
    if fps < 1 or fps > 240:
        raise ApiError(400, f"fps must be an integer in 1..240, got {fps}", "fps")
    counts = [s.frames for s in shapes if s.size == size]
    frames = g.frames if g.frames in counts else counts[0]  # seconds left out: the default shape's frames
    if fields.get("seconds"):
        asked = _number("seconds", fields["seconds"], float)
        near = [n for n in counts if math.isfinite(asked) and abs(asked - n / fps) <= 0.5 / fps]
        if not near:
            durations = " or ".join(f"{n} frames ({n / fps:g} s)" for n in counts)
            raise ApiError(400, f"seconds {fields['seconds']!r} is not a duration this bundle makes at {size}: it "
                                f"makes {durations} at {fps} fps (leave seconds out, or change fps)", "seconds")
        frames = near[0]
    seconds = frames / fps
    checks = [("seed", dict(seed=p["seed"])), ("num_inference_steps", dict(steps=p["num_inference_steps"])),
              ("guidance_scale", dict(guidance=p["guidance_scale"])),
              ("guidance_scale_2", dict(guidance_2=p["guidance_scale_2"])),
              ("flow_shift", dict(flow_shift=p["flow_shift"], steps=p["num_inference_steps"]))]
    if p["num_inference_steps"] is not None and p["num_inference_steps"] > MAX_STEPS:
        raise ApiError(400, f"num_inference_steps {p['num_inference_steps']} is more than this server runs per job "
                            f"({MAX_STEPS})", "num_inference_steps")
    for name, kwargs in checks:
        if all(v is None for v in kwargs.values()) or (name == "flow_shift" and p["flow_shift"] is None):
            continue
        try:
            pipe.settings(**{k: v for k, v in kwargs.items() if v is not None})
        except UserError as e:
            raise ApiError(400, str(e), name) from None
    image, last = images.get("input_reference"), images.get("last_image")
    try:
        kinds.check_images(kind, image, last)
    except UserError as e:
        raise ApiError(400, str(e).replace("--image FILE / image=...", "input_reference")
                       .replace("--last-image FILE / last_image=...", "last_image"),
                       "last_image" if "last image" in str(e) else "input_reference") from None
    for name, data in images.items():
        check_image(name, data)
    return {"prompt": prompt, "negative_prompt": fields.get("negative_prompt") or "", "seed": p["seed"] or 0,
            "steps": p["num_inference_steps"], "guidance": p["guidance_scale"], "guidance_2": p["guidance_scale_2"],
            "flow_shift": p["flow_shift"], "fps": fps, "seconds": f"{seconds:g}", "size": size, "frames": frames,
            "magcache": state.settings.magcache.to_json() if state.settings.magcache is not None else None}


def check_image(name: str, data: bytes) -> None:
    from PIL import Image

    from ..images import load_image

    if len(data) > MAX_IMAGE_BYTES:
        raise ApiError(400, f"{name} is larger than {MAX_IMAGE_BYTES >> 20} MB", name)
    try:
        with Image.open(io.BytesIO(data)) as probe:
            w, h = probe.size
    except Exception:  # noqa: BLE001  (any undecodable upload)
        raise ApiError(400, f"{name} is not an image Pillow can read (PNG, JPEG, WebP, ...)", name) from None
    if w * h > MAX_IMAGE_PIXELS:
        raise ApiError(400, f"{name} has {w}x{h} pixels, more than {MAX_IMAGE_PIXELS // 1_000_000} MP", name)
    try:
        load_image(Image.open(io.BytesIO(data)), name)
    except UserError as e:
        raise ApiError(400, str(e), name) from None


def decode_data_url(name: str, value: str) -> bytes:
    """JSON requests carry images as data URLs (data:image/png;base64,...) or bare base64."""
    payload = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{name} in a JSON request must be a base64 data URL (data:image/png;base64,...)",
                       name) from None


# -- the worker ----------------------------------------------------------------
def run_job(pipe: Any, params: dict[str, Any], image_bytes: list[bytes], video: Path | None,
            on_progress: Callable[[int], None] = lambda p: None,
            on_step_time: Callable[[float], None] = lambda s: None,
            on_stage: Callable[[str], None] = lambda stage: None) -> None:
    """Generate one job's video (every process of a multi-host job runs this; only process 0 writes).
    `on_progress` follows the denoising steps, `on_stage` each finished stage ("encode", "denoise", "decode")."""
    from PIL import Image

    from ..magcache import MagCache
    from ..video import write_video

    images = [Image.open(io.BytesIO(b)) for b in image_bytes]
    steps = pipe.settings(params["seed"], params["steps"], params["guidance"], params["flow_shift"],
                          params["guidance_2"]).steps
    # Jobs queued before bundles had several shapes carry their size but no frames: the default shape's.
    shape = {"size": params.get("size"), "frames": params.get("frames")}
    embeds = pipe.encode(params["prompt"], params["negative_prompt"], *(images + [None, None])[:2], **shape)
    on_stage("encode")
    last = [time.perf_counter()]

    def step_done(i: int) -> None:
        now = time.perf_counter()
        on_step_time(now - last[0])
        last[0] = now
        on_progress(min(99, int(100 * (i + 1) / steps)))

    magcache = MagCache(**params["magcache"]) if params.get("magcache") else None
    latents = pipe.denoise(embeds, params["seed"], params["steps"], params["guidance"], params["flow_shift"],
                           progress=False, on_step=step_done, guidance_2=params["guidance_2"], magcache=magcache,
                           **shape)
    on_stage("denoise")
    frames = pipe.decode(latents)
    on_stage("decode")
    if video is not None:
        write_video(frames[0], video, fps=params["fps"])


def worker(state: State) -> None:
    """Run queued jobs one at a time until draining; every failure is recorded on its job."""
    store = state.store
    while not state.draining.is_set():
        try:
            job = store.claim()
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
                        on_stage=lambda stage: lease.progress())
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
    except Exception as e:  # noqa: BLE001  (reported on /ready and in the log)
        state.load_error = f"{type(e).__name__}: {e}"
        log.error("could not load %s: %s", state.settings.bundle, state.load_error)


# -- metrics -------------------------------------------------------------------
@dataclass
class Metrics:
    registry: Any
    queue_depth: Any
    jobs: Any
    step_seconds: Any
    job_seconds: Any
    request_seconds: Any
    replica_jobs: Any


def make_metrics(store: JobStore) -> Metrics:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    counts: dict[str, Any] = {"at": 0.0, "value": {}}

    def count(status: str) -> int:  # one query per scrape, shared by the gauges
        if time.monotonic() - counts["at"] > 0.5:
            counts["value"], counts["at"] = store.counts(), time.monotonic()
        return counts["value"][status]

    queue = Gauge("wan_aot_queue_depth", "jobs waiting to run, in the queue every replica shares", registry=reg)
    queue.set_function(lambda: count("queued"))
    jobs = Gauge("wan_aot_jobs", "jobs in the shared store, by status", ["status"], registry=reg)
    for status in ("queued", "in_progress", "completed", "failed"):
        jobs.labels(status).set_function(lambda s=status: count(s))
    replica = Counter("wan_aot_replica_jobs", "jobs this replica ran, by outcome (lost: taken over by another)",
                      ["outcome"], registry=reg)
    for outcome in ("completed", "failed", "lost"):
        replica.labels(outcome)
    buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
    return Metrics(
        registry=reg, queue_depth=queue, jobs=jobs,
        step_seconds=Histogram("wan_aot_step_seconds", "one denoising step", registry=reg, buckets=buckets),
        job_seconds=Histogram("wan_aot_job_seconds", "one job, encode to mp4", registry=reg,
                              buckets=(*buckets, 600, 1800)),
        request_seconds=Histogram("wan_aot_request_seconds", "HTTP request latency", ["method", "route", "status"],
                                  registry=reg, buckets=buckets), replica_jobs=replica)


# -- the app -------------------------------------------------------------------
def create_app(state: State) -> FastAPI:
    app = FastAPI(title="wan-aot", docs_url=None, redoc_url=None)
    store = state.store

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = str(first.get("loc", ["", ""])[-1]) or None
        return JSONResponse(ApiError(400, f"{param}: {first.get('msg', 'invalid')}", param).body(), status_code=400)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(404)
    async def not_found(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(ApiError(404, f"no route {request.method} {request.url.path}").body(), status_code=404)

    @app.exception_handler(405)
    async def not_allowed(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                     code="method_not_allowed").body(), status_code=405)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        t0 = time.perf_counter()
        try:
            _authorize(request, state)
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
                raise ApiError(413, f"request body larger than {MAX_BODY_BYTES >> 20} MB")
            response = await call_next(request)
        except ApiError as e:
            response = JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        if state.metrics is not None:
            route = request.scope.get("route")
            state.metrics.request_seconds.labels(request.method, getattr(route, "path", "other"),
                                                 str(response.status_code)).observe(time.perf_counter() - t0)
        return response

    if state.settings.ui:
        add_playground(app)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    def ready() -> JSONResponse:
        if state.load_error:
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        if state.draining.is_set():
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ready", "model": state.model, "bundle_id": state.pipe.bundle_id})

    @app.get("/metrics")
    def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        """The OpenAI list of models: this server's bundle, with the shapes it makes (once loaded)."""
        if not state.ready.is_set():
            raise ApiError(503, "the model is still loading; retry when GET /ready answers 200", code="loading",
                           headers={"Retry-After": "5"})
        return {"object": "list", "data": [model_card(state)]}

    @app.post("/v1/videos")
    async def create(request: Request) -> JSONResponse:
        if state.draining.is_set():
            raise ApiError(503, "the server is shutting down and takes no new jobs; retry on another instance",
                           code="draining")
        if not state.ready.is_set():
            raise ApiError(503, "the model is still loading; retry when GET /ready answers 200", code="loading",
                           headers={"Retry-After": "5"})
        fields, images = await _read_body(request)
        # Validation (image decoding, the schedule check) and the fsync'd insert run off the event loop.
        return await run_in_threadpool(_create, state, fields, images)

    @app.get("/v1/videos")
    def list_videos(limit: int = 20, after: str | None = None, order: str = "desc") -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be in 1..100, got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", "order")
        try:
            jobs, more = store.list(limit, after, order)
        except KeyError:
            raise ApiError(400, f"after {after!r} is not a known video id", "after") from None
        data = [j.to_api() for j in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/videos/{video_id}")
    def retrieve(video_id: str) -> JSONResponse:
        return JSONResponse(_job(store, video_id).to_api(), headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})

    @app.get("/v1/videos/{video_id}/content")
    def content(video_id: str, variant: str = "video") -> Response:
        job = _job(store, video_id)
        if variant != "video":
            raise ApiError(400, f"variant {variant!r} is not available: only 'video'", "variant")
        if job.status != "completed":
            raise ApiError(409, f"video {video_id} is {job.status}, not completed: poll GET /v1/videos/{video_id}",
                           code="video_not_ready")
        if not job.video or not store.storage.exists(job.video):
            raise ApiError(404, f"the file of video {video_id} is gone from the video storage")
        path = store.storage.local_path(job.video)
        if path is not None:
            return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")
        return StreamingResponse(store.storage.chunks(job.video), media_type="video/mp4",
                                 headers={"Content-Disposition": f'attachment; filename="{video_id}.mp4"'})

    @app.delete("/v1/videos/{video_id}")
    def delete(video_id: str) -> dict[str, Any]:
        try:
            job = store.delete(video_id)
        except RuntimeError:
            raise ApiError(409, f"video {video_id} is being generated; delete it when it is done",
                           code="video_in_progress") from None
        if job is None:
            raise ApiError(404, f"no video {video_id!r}")
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return app


UI_DIR = Path(__file__).with_name("ui")
UI_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
# The page runs only its own script file (no inline script, no eval), talks only to this server, and shows media
# only from it or from the blobs it downloaded.
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
                               "media-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_playground(app: FastAPI) -> None:
    """GET / (the page) and GET /ui/{app.js, style.css}: static files; the page uses the public API as any client
    does, with the same authentication (it asks for the key), so it adds no way around the API's checks."""

    @app.get("/", include_in_schema=False)
    def page() -> Response:
        return Response((UI_DIR / "index.html").read_bytes(), media_type="text/html; charset=utf-8",
                        headers=UI_HEADERS)

    @app.get("/ui/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in UI_FILES:
            raise ApiError(404, f"no route GET /ui/{name}")
        return Response((UI_DIR / name).read_bytes(), media_type=UI_FILES[name], headers=UI_HEADERS)


def model_card(state: State) -> dict[str, Any]:
    """The OpenAI model object of the bundle served, with what a client needs to pick a request's shape: each
    shape's size, frames and seconds at the bundle's fps (the first is the default)."""
    pipe = state.pipe
    m = pipe.manifest
    fps = m.defaults.fps
    manifest = state.settings.bundle / "manifest.json"
    created = int(manifest.stat().st_mtime) if manifest.is_file() else 0  # when the bundle was written
    return {"id": state.model, "object": "model", "created": created, "owned_by": "wan-aot",
            "bundle_id": pipe.bundle_id, "kind": pipe.kind.name, "title": pipe.kind.title,
            "image": pipe.kind.image, "last_image": pipe.kind.last_image, "experts": pipe.kind.experts,
            "fps": fps, "defaults": {"steps": m.defaults.steps, "guidance": m.defaults.guidance},
            "dtype": m.dtype, "quantize": m.quantize,
            "shapes": [{"size": g.size, "frames": g.frames, "seconds": f"{g.frames / fps:g}", "default": i == 0}
                       for i, g in enumerate(m.shapes)]}


def _create(state: State, fields: dict[str, Any], images: dict[str, bytes]) -> JSONResponse:
    params = parse_request(fields, images, state)
    try:
        job = state.store.add(model=state.model, size=params["size"], seconds=params["seconds"],
                              prompt=params["prompt"], params=params,
                              images=[images[k] for k in _IMAGE_FIELDS if k in images],
                              queue_size=state.settings.queue_size)
    except QueueFull:
        recent = state.job_seconds or [10.0]  # about one job's time frees a place in the queue
        retry = max(1, math.ceil(sum(recent) / len(recent)))
        raise ApiError(429, f"the queue is full ({state.settings.queue_size} jobs waiting): retry in about "
                            f"{retry} s", headers={"Retry-After": str(retry)}) from None
    state.wake.set()
    return JSONResponse(job.to_api())


async def _read_limited(request: Any) -> bytes:
    """The body, refusing more than MAX_BODY_BYTES as it streams in (chunked bodies have no Content-Length)."""
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise ApiError(413, f"request body larger than {MAX_BODY_BYTES >> 20} MB")
        chunks.append(chunk)
    return b"".join(chunks)


def _job(store: JobStore, video_id: str) -> Job:
    job = store.get(video_id)
    if job is None:
        raise ApiError(404, f"no video {video_id!r}")
    return job


def _authorize(request: Any, state: State) -> None:
    import hmac

    key = state.settings.api_key
    if key is None or not request.url.path.startswith("/v1/"):
        return
    header = request.headers.get("authorization", "")
    given = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if not given or not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                       headers={"WWW-Authenticate": "Bearer"})


async def _read_body(request: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(fields, images) from a JSON or multipart/form-data body."""
    ctype = request.headers.get("content-type", "")
    images: dict[str, bytes] = {}
    if ctype.startswith("application/json"):
        try:
            fields = json.loads(await _read_limited(request))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "the body must be a JSON object")
        for name in _IMAGE_FIELDS:
            value = fields.pop(name, None)
            if value is not None:
                if not isinstance(value, str):
                    raise ApiError(400, f"{name} must be a base64 data URL string", name)
                images[name] = decode_data_url(name, value)
        return fields, images
    if ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        if request.headers.get("content-length") is None:  # chunked: bound it before the form parser reads it
            body = await _read_limited(request)
            request._body = body  # Starlette parses the form from the cached body  # noqa: SLF001
        form = await request.form(max_files=len(_IMAGE_FIELDS), max_fields=64, max_part_size=MAX_IMAGE_BYTES)
        fields = {}
        for name, value in form.multi_items():
            if hasattr(value, "read"):  # an uploaded file
                if name not in _IMAGE_FIELDS:
                    raise ApiError(400, f"unexpected file field {name!r} (images go in input_reference)", name)
                images[name] = await value.read()
            elif name in _IMAGE_FIELDS:
                images[name] = decode_data_url(name, value)
            else:
                fields[name] = value
        return fields, images
    raise ApiError(400, f"unsupported content type {ctype or '(none)'!r}: send JSON or multipart/form-data")


# -- running it ----------------------------------------------------------------
def serve(settings: Settings, host: str, port: int, loader: Callable[[], Any],
          broadcast: Callable[[dict[str, Any] | None], None] | None = None,
          on_exit: Callable[[], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT: the first one drains (503 for new jobs, the running job finishes), a
    second one stops at once."""
    import uvicorn

    store = open_store(settings.jobs_dir, settings.queue, settings.videos_url, settings.lease)
    for job in store.expire_dead_local_owners():
        log.warning("job %s was running when the server stopped: %s", job.id,
                    "queued again" if job.attempts < store.max_attempts else "failed, out of attempts")
    state = State(settings=settings, store=store, broadcast=broadcast)
    state.metrics = make_metrics(store)
    app = create_app(state)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if state.draining.is_set():  # a second signal: stop now
                self.force_exit = True
                return super().handle_exit(sig, frame)
            log.info("draining: no new jobs; finishing the running one, then exiting")
            state.draining.set()
            state.wake.set()

            def finish() -> None:
                state.idle.wait()
                self.should_exit = True

            threading.Thread(target=finish, daemon=True).start()

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=10))
    loader_thread = threading.Thread(target=load_and_compile, args=(state, loader), daemon=True)
    loader_thread.start()

    def work() -> None:
        state.ready.wait()
        worker(state)

    state.idle.set()
    worker_thread = threading.Thread(target=work, daemon=True)
    worker_thread.start()
    log.info("serving %s on http://%s:%d (replica %s; jobs in %s)", settings.bundle, host, port, store.owner,
             settings.queue and "the PostgreSQL queue" or settings.jobs_dir)
    server.run()
    state.draining.set()
    state.wake.set()
    if state.ready.is_set():
        worker_thread.join(timeout=5)
    if on_exit is not None:
        on_exit()
    store.close()
    return 0

