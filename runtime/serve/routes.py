"""The HTTP app: the OpenAI videos API, health, readiness and metrics, behind the API key and the body limit.

    POST   /v1/videos              create a job (JSON or multipart form; `input_reference` = the image)
    GET    /v1/videos/{id}         the job (queued / in_progress / completed / failed, progress 0-100)
    GET    /v1/videos/{id}/content the mp4
    GET    /v1/videos              newest first (limit, after, order)
    GET    /v1/models              the bundle served and its shapes (size, frames, seconds)
    DELETE /v1/videos/{id}
    GET    /health  /ready  /metrics  /openapi.json
    GET    /                       the playground page (runtime/serve/ui/; off with --no-ui)

Every answer but a success is an error in the OpenAI shape (errors.py), a 405 with the `Allow` header. Before any
route: the Host and Origin checks and the API key, which names the request's tenant (access.py); a tenant sees only
its own videos: another's id is a 404, as an unknown one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.routing import Match

from . import access, loras
from . import openapi as oa
from .errors import ApiError
from .jobs import Job, JobStore, QueueFull
from .metrics import method_label
from .playground import add_playground
from .schema import FILE_FIELDS, POLL_AFTER_MS, Body, parse_request, read_body, seconds_of
from .state import State

log = logging.getLogger("runtime")
VideoId = Annotated[str, Path(description="a video's id, as POST /v1/videos answered it")]


def create_app(state: State) -> FastAPI:
    app = FastAPI(title="wan-aot", version="1", docs_url=None, redoc_url=None,
                  description="The OpenAI videos API for one exported Wan bundle (runtime/serve/README.md).")
    store = state.store

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = str(first.get("loc", ["", ""])[-1]) or None
        return _answer(ApiError(400, f"{param}: {first.get('msg', 'invalid')}", param))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _answer(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        """Starlette's own answers (no route, a method the route lacks, a malformed form) in the OpenAI shape."""
        if e.status_code == 404:
            return _answer(ApiError(404, f"no route {request.method} {request.url.path}"))
        if e.status_code == 405:
            allow = ", ".join(allowed_methods(app, request.scope))
            return _answer(ApiError(405, f"{request.method} is not allowed on {request.url.path}: use {allow}",
                                    code="method_not_allowed", headers={"Allow": allow}))
        return _answer(ApiError(e.status_code, str(e.detail), headers=dict(e.headers or {})))

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        t0 = time.perf_counter()
        limit = state.settings.limits.max_body_bytes or state.offer.max_body_bytes
        route = route_of(app, request.scope)
        try:
            access.check_host(request.url.path, request.headers, state.settings.names)
            access.check_origin(request.method, request.headers, state.settings.names)
            request.state.tenant = access.authorize(request.url.path, request.headers, state.settings.keys)
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                raise ApiError(413, f"request body larger than {limit / (1 << 20):g} MB (--max-body-mb)")
            response = await call_next(request)
        except ApiError as e:
            response = _answer(e)
        except Exception:  # a bug: one answer in the OpenAI shape, and the traceback in the log for whoever fixes it
            log.exception("%s %s: internal error", method_label(request.method), route)
            response = _answer(ApiError(500, "internal error (the server's log has the details)"))
        if state.metrics is not None:
            state.metrics.request_seconds.labels(method_label(request.method), route,
                                                 str(response.status_code)).observe(time.perf_counter() - t0)
        return response

    if state.settings.ui:
        add_playground(app)

    @app.get("/health", operation_id="health", responses={200: {"model": oa.Health}}, response_model=None,
             summary="Liveness: 200 as soon as the process serves HTTP")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", operation_id="ready", response_model=None, summary="Readiness: 200 once every program is "
             "compiled", responses={200: {"model": oa.Ready}, 503: {"model": oa.Ready, "description": "loading, "
                                                                    "draining, or failed (with `error`)"}})
    def ready() -> JSONResponse:
        if state.load_error:
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        if state.draining.is_set():
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ready", "model": state.model, "bundle_id": state.pipe.bundle_id})

    @app.get("/metrics", operation_id="metrics", response_class=PlainTextResponse, summary="Prometheus metrics",
             responses={200: {"description": "the Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", operation_id="listModels", response_model=None, summary="The bundle served",
             responses={200: {"model": oa.ModelList}, **oa.errors(503)})
    def models(request: Request) -> dict[str, Any]:
        """The OpenAI list of models: this server's bundle, with the shapes it makes and the LoRA adapters the caller
        may use (once loaded)."""
        if not state.ready.is_set():
            raise ApiError(503, "the model is still loading; retry when GET /ready answers 200", code="loading",
                           headers={"Retry-After": "5"})
        return {"object": "list", "data": [model_card(state, request.state.tenant)]}

    @app.post("/v1/videos", operation_id="createVideo", summary="Queue a job",
              openapi_extra={"requestBody": oa.create_request(state.offer)},
              responses={200: {"model": oa.Video, "description": "the job, queued", "links": oa.VIDEO_LINKS},
                         **oa.errors(400, 408, 413, 415, 429, 503)})
    async def create(request: Request) -> JSONResponse:
        if state.draining.is_set():
            raise ApiError(503, "the server is shutting down and takes no new jobs; retry on another instance",
                           code="draining")
        if not state.ready.is_set():
            raise ApiError(503, "the model is still loading; retry when GET /ready answers 200", code="loading",
                           headers={"Retry-After": "5"})
        tenant = request.state.tenant
        # A full queue is answered before the body is read or any of its media decoded: it costs nothing but this.
        await run_in_threadpool(_room, state, tenant)
        with state.uploads.take():  # the bodies read and checked at once, each up to --max-body-mb
            try:
                body = await read_body(request, state.settings.limits.max_body_bytes or state.offer.max_body_bytes,
                                       state.offer.max_part_bytes)
            except ClientDisconnect:  # the body timeout closed the connection (protocol.py), or the client left
                raise ApiError(408, "the request's body did not arrive in time (--body-timeout), or the client went "
                                    "away") from None
            # Validation (media decoding, the schedule check) and the fsync'd insert run off the event loop.
            return await run_in_threadpool(_create, state, body, tenant)

    @app.get("/v1/videos", operation_id="listVideos", response_model=None, summary="Jobs, newest first",
             responses={200: {"model": oa.VideoList}, **oa.errors(400, 404)})
    def list_videos(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                    after: Annotated[str | None, Query(description="list the jobs after this video id")] = None,
                    order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
        try:
            jobs, more = store.list(limit, after, order, tenant=request.state.tenant)
        except KeyError:
            raise ApiError(404, f"after {after!r} is not a known video id", "after") from None
        data = [j.to_api() for j in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/videos/{video_id}", operation_id="retrieveVideo", response_model=None, summary="A job",
             responses={200: {"model": oa.Video, "headers": {"openai-poll-after-ms": {
                 "description": "how long a client polling the job waits", "schema": {"type": "integer"}}}},
                        **oa.errors(404)})
    def retrieve(request: Request, video_id: VideoId) -> JSONResponse:
        return JSONResponse(_job(store, video_id, request.state.tenant).to_api(),
                            headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})

    @app.get("/v1/videos/{video_id}/content", operation_id="downloadVideoContent", response_class=Response,
             summary="A completed job's mp4",
             responses={200: {"description": "the mp4", "content": {"video/mp4": {"schema": {
                 "type": "string", "format": "binary"}}}}, **oa.errors(400, 404, 409, 416)})
    def content(request: Request, video_id: VideoId, variant: Literal["video"] = "video") -> Response:
        job = _job(store, video_id, request.state.tenant)
        if job.status != "completed":
            raise ApiError(409, f"video {video_id} is {job.status}, not completed: poll GET /v1/videos/{video_id}",
                           code="video_not_ready")
        if not job.video or not store.storage.exists(job.video):
            raise ApiError(404, f"the file of video {video_id} is gone from the video storage")
        path = store.storage.local_path(job.video)
        if path is not None:
            _check_range(request, path)
            return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")
        return StreamingResponse(store.storage.chunks(job.video), media_type="video/mp4",
                                 headers={"Content-Disposition": f'attachment; filename="{video_id}.mp4"'})

    @app.delete("/v1/videos/{video_id}", operation_id="deleteVideo", response_model=None,
                summary="Remove a job and its video",
                responses={200: {"model": oa.VideoDeleted}, **oa.errors(404, 409)})
    def delete(request: Request, video_id: VideoId) -> dict[str, Any]:
        try:
            job = store.delete(video_id, request.state.tenant)
        except RuntimeError:
            raise ApiError(409, f"video {video_id} is being generated; delete it when it is done",
                           code="video_in_progress") from None
        if job is None:
            raise ApiError(404, f"no video {video_id!r}")
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = oa.finish(doc, keyed=state.settings.keys is not None)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]
    return app


class _AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: an error that quotes what a client sent can always be written."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def _answer(e: ApiError) -> JSONResponse:
    """The error's answer, and one line in the log (what the client sent, quoted in it, cut short and escaped)."""
    if e.status not in (401, 404, 409):  # the ordinary ones: a wrong key, polls and deletes
        text = e.message.encode("ascii", "backslashreplace").decode()
        log.info("answered %d %s: %s", e.status, e.code, " ".join(text.split())[:300])
    return _AsciiJSON(e.body(), status_code=e.status, headers=e.headers)


def allowed_methods(app: FastAPI, scope: dict[str, Any]) -> list[str]:
    """The methods the routes at this request's path take (a 405's `Allow`, RFC 9110)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if route.matches(scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def route_of(app: FastAPI, scope: dict[str, Any]) -> str:
    """The route template a request was for (its metrics label), also when it never reached the route (a 401, a
    413, a 405); `other` where no route's path matches."""
    partial = None
    for route in app.router.routes:
        match = route.matches(scope)[0]
        if match == Match.FULL:
            return getattr(route, "path", "other")
        if match == Match.PARTIAL and partial is None:
            partial = getattr(route, "path", "other")
    return partial or "other"


def model_card(state: State, tenant: str | None = None) -> dict[str, Any]:
    """The OpenAI model object of the bundle served, with what a client needs to pick a request's shape: each
    shape's size, frames and seconds at the bundle's fps (the first is the default); and the LoRA adapters offered
    (those `tenant` may use)."""
    pipe = state.pipe
    m = pipe.manifest
    fps = m.defaults.fps
    allowed = _allowed_loras(state, tenant)
    manifest = state.settings.bundle / "manifest.json"
    created = int(manifest.stat().st_mtime) if manifest.is_file() else 0  # when the bundle was written
    return {"id": state.model, "object": "model", "created": created, "owned_by": "wan-aot",
            "bundle_id": pipe.bundle_id, "kind": pipe.kind.name, "title": pipe.kind.title,
            "image": pipe.kind.image, "last_image": pipe.kind.takes_last_image, "video": state.offer.video_reference,
            "mask": pipe.kind.vace, "animate": pipe.kind.animate, "forcing": pipe.kind.forcing,
            **({"max_seconds": state.offer.max_seconds} if pipe.kind.forcing else {}),
            "reference_images": list(state.offer.reference_counts),
            "video_to_video": m.video_to_video, "experts": pipe.kind.experts, "fps": fps,
            "defaults": {"steps": state.offer.steps, "guidance": m.defaults.guidance,
                         "guidance_2": m.defaults.guidance_2, "flow_shift": m.defaults.flow_shift,
                         "sampler": m.defaults.sampler,
                         "sigmas": None if m.defaults.sigmas is None else list(m.defaults.sigmas)},
            "dtype": m.dtype, "quantize": m.quantize,
            "shapes": [{"size": g.size, "frames": g.frames, "seconds": seconds_of(g.frames, fps), "default": i == 0,
                        "reference_images": g.reference_images}
                       for i, g in enumerate(m.shapes)],
            "loras": [loras.card(a, pipe.kind.experts > 1) for a in state.offer.loras
                      if allowed is None or a.name in allowed],
            "max_loras": state.offer.max_loras}


def _allowed_loras(state: State, tenant: str | None) -> frozenset[str] | None:
    """The adapters `tenant` may use (its `loras=` in the keys file), None: any."""
    keys = state.settings.keys
    return keys.loras(tenant) if keys is not None and tenant is not None else None


def _room(state: State, tenant: str) -> None:
    """429 unless the queue has room for a job of `tenant`."""
    try:
        state.store.room(tenant, state.settings.queue_size, state.settings.tenant_queue_size)
    except QueueFull as e:
        raise _queue_full(state, e) from None


def _queue_full(state: State, e: QueueFull) -> ApiError:
    recent = state.job_seconds or [10.0]  # about one job's time frees a place in the queue
    retry = max(1, math.ceil(sum(recent) / len(recent)))
    if e.mine:
        message = f"you have {e.waiting} jobs waiting, as many as one tenant may: retry in about {retry} s"
    else:
        message = f"the queue is full ({e.waiting} jobs waiting): retry in about {retry} s"
    return ApiError(429, message, headers={"Retry-After": str(retry)})


def _create(state: State, body: Body, tenant: str) -> JSONResponse:
    with state.decodes:  # a decoded image (or video) can take far more memory than its upload: a few at a time
        params = parse_request(body, state.offer, state.pipe,
                               state.settings.magcache.to_json() if state.settings.magcache is not None else None)
    loras.check_tenant(params.get("lora"), _allowed_loras(state, tenant))
    try:
        job = state.store.add(model=state.model, size=params["size"], seconds=params["seconds"],
                              prompt=params["prompt"], params=params,
                              images=[data for name in FILE_FIELDS for data in body.files.get(name, [])],
                              queue_size=state.settings.queue_size, tenant=tenant,
                              tenant_queue_size=state.settings.tenant_queue_size)
    except QueueFull as e:
        raise _queue_full(state, e) from None
    state.wake.set()
    return JSONResponse(job.to_api())


def _job(store: JobStore, video_id: str, tenant: str) -> Job:
    job = store.get(video_id, tenant)
    if job is None:  # another tenant's is not there either: a 404, which tells nothing of other tenants' ids
        raise ApiError(404, f"no video {video_id!r}")
    return job


def _check_range(request: Request, path: Any) -> None:
    """A Range header FileResponse would refuse, refused here in the OpenAI shape (FileResponse answers in text)."""
    header = request.headers.get("range")
    if header is None:
        return
    size = path.stat().st_size
    try:
        FileResponse._parse_range_header(header, size)  # noqa: SLF001  (the parser FileResponse itself uses)
    except MalformedRangeHeader as e:
        raise ApiError(400, f"Range {header[:100]!r}: {e.content}", "range") from None
    except RangeNotSatisfiable:
        raise ApiError(416, f"Range {header[:100]!r} is outside the video ({size} bytes)",
                       headers={"Content-Range": f"bytes */{size}"}) from None
