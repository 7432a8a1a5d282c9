"""The HTTP app: the OpenAI videos API, health, readiness and metrics, behind the API key and the body limit.

    POST   /v1/videos              create a job (JSON or multipart form; `input_reference` = the image)
    GET    /v1/videos/{id}         the job (queued / in_progress / completed / failed, progress 0-100)
    GET    /v1/videos/{id}/content the mp4
    GET    /v1/videos              newest first (limit, after, order)
    GET    /v1/models              the bundle served and its shapes (size, frames, seconds)
    GET    /                       the playground page (runtime/serve/ui/; off with --no-ui)
    DELETE /v1/videos/{id}
    GET    /health  /ready  /metrics
"""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .errors import ApiError
from .jobs import Job, JobStore, QueueFull
from .playground import add_playground
from .schema import _IMAGE_FIELDS, MAX_BODY_BYTES, POLL_AFTER_MS, _read_body, parse_request
from .state import State


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
