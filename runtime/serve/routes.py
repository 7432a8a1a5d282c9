"""The HTTP app: the OpenAI videos API, health, readiness and metrics, behind the API key and the body limit.

    POST   /v1/videos              create a job (JSON or multipart form; `input_reference` = the image)
    GET    /v1/videos/{id}         the job (queued / in_progress / completed / failed, progress 0-100)
    GET    /v1/videos/{id}/content the mp4; ?variant=thumbnail (a WebP: the live preview while it runs, then the first
                                   frame) or spritesheet (a JPEG grid of frames)
    GET    /v1/videos/{id}/stream.m3u8   the live stream (HLS, runtime/hls.py): a segment as each part is decoded,
    GET    /v1/videos/{id}/stream/{n}.ts  ended once the job ends; served from the video storage by any replica
    GET    /v1/videos              newest first (limit, after, order)
    GET    /v1/models              the bundle served and its shapes (size, frames, seconds)
    DELETE /v1/videos/{id}         remove it (a queued one never runs; a running one stops at its next step)
    POST   /v1/videos/{id}/cancel  stop it, keeping it: failed, error code `cancelled`
    POST   /v1/videos/{id}/remix, /v1/videos/edits, /v1/videos/extensions   jobs from a video (derive.py)
    POST   /v1/images/edits        an image edit (ChronoEdit bundles), answered when its job ends (images.py)
    /v1/webhook_endpoints ...      webhook endpoints (webhooks.py)
    GET    /health  /ready  /metrics  /openapi.json
    GET    /                       the playground page (runtime/serve/ui/; off with --no-ui)
    GET    /v1/realtime/video      a realtime session, a WebSocket (AnyFlow-FAR bundles; realtime.py)

Every answer but a success is an error in the OpenAI shape (errors.py), a 405 with the `Allow` header. Before any
route: the Host and Origin checks and the API key, which names the request's tenant (access.py); a tenant sees only
its own videos: another's id is a 404, as an unknown one.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.routing import Match

from .. import hls
from . import access, derive, images, intake, loras, realtime, thumbnails, webhooks
from . import openapi as oa
from .db import DatabaseUnavailable
from .errors import ApiError
from .jobs import Job, JobStore, NotCancellable, derived_keys
from .metrics import method_label
from .playground import add_playground
from .schema import FILE_FIELDS, POLL_AFTER_MS, Body, parse_request, seconds_of
from .state import State
from .storage import StorageUnavailable

log = logging.getLogger("runtime")
RETRY_S = 5  # Retry-After while the job database or the video store is away
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

    @app.exception_handler(DatabaseUnavailable)
    async def database_away(request: Request, e: DatabaseUnavailable) -> JSONResponse:
        return _answer(ApiError(503, "the job database cannot be reached right now (restarting?); retry in a few "
                                     "seconds", code="database_unavailable", headers={"Retry-After": str(RETRY_S)}))

    @app.exception_handler(StorageUnavailable)
    async def storage_away(request: Request, e: StorageUnavailable) -> JSONResponse:
        if state.metrics is not None:
            state.metrics.storage_errors.labels("unavailable").inc()
        log.warning("%s %s: %s", method_label(request.method), route_of(app, request.scope), e)
        return _answer(ApiError(503, "the video store cannot be reached right now; retry in a few seconds",
                                code="storage_unavailable", headers={"Retry-After": str(RETRY_S)}))

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
                                                                    "draining, failed (with `error`), or the job "
                                                                    "database cannot be reached"}})
    def ready() -> JSONResponse:
        if state.load_error:
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        if state.draining.is_set():
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if not store.db.ping():  # no job can be created, read or run: a load balancer sends requests elsewhere
            return JSONResponse({"status": "database_unavailable"}, status_code=503,
                                headers={"Retry-After": str(RETRY_S)})
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
                         **oa.errors(400, 408, 413, 415, 429, 503, 507)})
    async def create(request: Request) -> JSONResponse:
        intake.check_ready(state)
        tenant = request.state.tenant
        # A full queue is answered before the body is read or any of its media decoded: it costs nothing but this.
        await run_in_threadpool(intake.check_room, state, tenant)
        with state.uploads.take():  # the bodies read and checked at once, each up to --max-body-mb
            body = await intake.read(state, request)
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
             summary="A completed job's mp4, thumbnail or spritesheet; a running job's live preview",
             responses={200: {"description": "variant=video: the mp4; thumbnail: a WebP at the video's size (while the "
                                             "job runs, the current estimate of its middle frame; then its first "
                                             "frame); spritesheet: a JPEG grid of evenly spaced frames "
                                             "(runtime/serve/thumbnails.py gives its geometry)",
                              "content": {m: {"schema": {"type": "string", "format": "binary"}}
                                          for m in ("video/mp4", "image/webp", "image/jpeg",
                                                    *(("image/png",) if images.edits(state.offer) else ()))}},
                        **oa.errors(400, 404, 409, 416)})
    def content(request: Request, video_id: VideoId,
                variant: Annotated[Literal["video", "thumbnail", "spritesheet"], Query(
                    description="video (the mp4), thumbnail (WebP) or spritesheet (JPEG)")] = "video") -> Response:
        job = _job(store, video_id, request.state.tenant)
        if variant == "thumbnail" and job.status == "in_progress":
            return _live_preview(store, job)
        if job.status != "completed":
            raise ApiError(409, f"video {video_id} is {job.status}, not completed: poll GET /v1/videos/{video_id}",
                           code="video_not_ready")
        if not job.video or not store.storage.exists(job.video):
            raise ApiError(404, f"the file of video {video_id} is gone from the video storage")
        if variant != "video":
            return _derived_image(store, job, variant)
        path = store.storage.local_path(job.video)
        ext = job.video.rsplit(".", 1)[1]  # mp4; png: an image edit's (images.py)
        media_type = "image/png" if ext == "png" else "video/mp4"
        if path is not None:
            _check_range(request, path)
            return FileResponse(path, media_type=media_type, filename=f"{video_id}.{ext}")
        return StreamingResponse(store.storage.chunks(job.video), media_type=media_type,
                                 headers={"Content-Disposition": f'attachment; filename="{video_id}.{ext}"'})

    @app.get("/v1/videos/{video_id}/stream.m3u8", operation_id="streamVideo", response_class=Response,
             summary="The video as an HLS live stream while it is made: an EVENT playlist, a segment added as each "
                     "part is decoded, ended (#EXT-X-ENDLIST) when the job ends",
             responses={200: {"description": "the playlist (no segments yet while the job waits or its first part "
                                             "is made); its segment URIs are relative: stream/<n>.ts",
                              "content": {hls.PLAYLIST_TYPE: {"schema": {"type": "string"}}}},
                        **oa.errors(404)})
    def stream_playlist(request: Request, video_id: VideoId) -> Response:
        job = _job(store, video_id, request.state.tenant)
        return Response(_playlist(store, job), media_type=hls.PLAYLIST_TYPE, headers={"Cache-Control": "no-store"})

    @app.get("/v1/videos/{video_id}/stream/{segment}.ts", operation_id="streamSegment", response_class=Response,
             summary="One segment of the live stream (MPEG-TS, H.264): written once, never changed",
             responses={200: {"description": "the segment", "content": {hls.SEGMENT_TYPE: {
                 "schema": {"type": "string", "format": "binary"}}}}, **oa.errors(404)})
    def stream_segment(request: Request, video_id: VideoId, segment: Annotated[int, Path(
            ge=0, le=999_999_999, description="the segment's number, from 0, as the playlist names it")]) -> Response:
        job = _job(store, video_id, request.state.tenant)
        key = store.stream_key(job, hls.segment_name(segment))
        try:
            data = store.storage.read(key)
        except (FileNotFoundError, OSError):
            raise ApiError(404, f"video {video_id}'s stream has no segment {segment} (yet): the playlist, GET "
                                f"/v1/videos/{video_id}/stream.m3u8, names those there are") from None
        return Response(data, media_type=hls.SEGMENT_TYPE,
                        headers={"Cache-Control": "private, max-age=31536000, immutable"})

    @app.delete("/v1/videos/{video_id}", operation_id="deleteVideo", response_model=None,
                summary="Remove a job and its video: a queued job never runs, a running one stops at its next step "
                        "or stage boundary (on whichever replica runs it) and stores nothing",
                responses={200: {"model": oa.VideoDeleted}, **oa.errors(404)})
    def delete(request: Request, video_id: VideoId) -> dict[str, Any]:
        job = store.delete(video_id, request.state.tenant)
        if job is None:
            raise ApiError(404, f"no video {video_id!r}")
        if job.status == "in_progress":
            log.info("job %s: deleted while it ran; its replica stops at the next step", video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @app.post("/v1/videos/{video_id}/cancel", operation_id="cancelVideo", response_model=None,
              summary="Stop a queued or running job, keeping it: failed, with error code `cancelled` (a running one "
                      "stops at its next step or stage boundary, on whichever replica runs it, and stores nothing)",
              responses={200: {"model": oa.Video, "description": "the job, cancelled"}, **oa.errors(404, 409)})
    def cancel(request: Request, video_id: VideoId) -> dict[str, Any]:
        try:
            job = store.cancel(video_id, request.state.tenant)
        except NotCancellable as e:
            raise ApiError(409, f"video {video_id} is {e.status} already: there is nothing to cancel",
                           code="video_not_cancellable") from None
        if job is None:
            raise ApiError(404, f"no video {video_id!r}")
        state.wake_webhooks()
        return job.to_api()

    derive_routes(app, state)
    images.add_routes(app, state)
    webhooks.add_routes(app, state)
    realtime.add_routes(app, state)  # GET /v1/realtime/video, a WebSocket (AnyFlow-FAR bundles)

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
    """The methods the routes at this request's path take (a 405's `Allow`, RFC 9110): those of a route whose path is
    this one exactly (POST /v1/videos/edits) where there is one, not also those of a template it happens to fit
    (/v1/videos/{video_id})."""
    matched = [route for route in app.router.routes if route.matches(scope)[0] != Match.NONE]
    exact = [route for route in matched if "{" not in getattr(route, "path", "{")]
    return sorted({m for route in exact or matched for m in getattr(route, "methods", None) or set()})


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
    allowed = intake.allowed_loras(state, tenant)
    manifest = state.settings.bundle / "manifest.json"
    created = int(manifest.stat().st_mtime) if manifest.is_file() else 0  # when the bundle was written
    return {"id": state.model, "object": "model", "created": created, "owned_by": "wan-aot",
            "bundle_id": pipe.bundle_id, "kind": pipe.kind.name, "title": pipe.kind.title,
            "image": pipe.kind.image, "last_image": pipe.kind.takes_last_image, "video": state.offer.video_reference,
            "mask": pipe.kind.vace, "animate": pipe.kind.animate, "animate_2": pipe.kind.animate2,
            "forcing": pipe.kind.forcing,
            "helios": pipe.kind.helios, **({"pyramid": state.offer.pyramid} if pipe.kind.helios else {}),
            "image_edit": images.edits(state.offer),
            **({"edit_sizes": images.edit_sizes(state.offer)} if images.edits(state.offer) else {}),
            **({"max_seconds": state.offer.max_seconds} if pipe.kind.any_length else {}),
            "reference_images": list(state.offer.reference_counts),
            "video_to_video": m.video_to_video, "experts": pipe.kind.experts, "fps": fps,
            "defaults": {"steps": state.offer.steps, "guidance": m.defaults.guidance,
                         "guidance_2": m.defaults.guidance_2, "flow_shift": m.defaults.flow_shift,
                         "sampler": m.defaults.sampler,
                         "sigmas": None if m.defaults.sigmas is None else list(m.defaults.sigmas)},
            "dtype": m.dtype, "quantize": m.quantize,
            "shapes": [{"size": g.size, "frames": g.frames, "seconds": seconds_of(g.frames, fps), "default": i == 0,
                        "reference_images": g.reference_images if pipe.kind.reference_images else 0}
                       for i, g in enumerate(m.shapes)],
            "loras": [loras.card(a, pipe.kind.experts > 1) for a in state.offer.loras
                      if allowed is None or a.name in allowed],
            "max_loras": state.offer.max_loras}


def _create(state: State, body: Body, tenant: str) -> JSONResponse:
    with state.decodes:  # a decoded image (or video) can take far more memory than its upload: a few at a time
        params = parse_request(body, state.offer, state.pipe,
                               state.settings.magcache.to_json() if state.settings.magcache is not None else None)
    return _queue(state, params, [data for name in FILE_FIELDS for data in body.files.get(name, [])], tenant)


def _queue(state: State, params: dict[str, Any], files: list[bytes], tenant: str) -> JSONResponse:
    return JSONResponse(intake.add_job(state, params, files, tenant).to_api())


def derive_routes(app: FastAPI, state: State) -> None:
    """POST /v1/videos/{id}/remix, /v1/videos/edits and /v1/videos/extensions: jobs made from a video (derive.py),
    queued as a create request is, after the same checks."""
    store = state.store

    async def derived(request: Request, op: str, path_id: str | None = None) -> JSONResponse:
        intake.check_ready(state)
        derive.check_way(op, state.offer)
        tenant = request.state.tenant
        await run_in_threadpool(intake.check_room, state, tenant)
        with state.uploads.take():
            body = await intake.read(state, request, () if path_id is not None else ("video",))
            ref = derive.reference(body.fields, path_id)
            derive.check_fields(body, op, state.offer)
            upload = (body.files.pop("video", None) or [None])[0]
            return await run_in_threadpool(_derive, state, store, body, tenant, op, ref, upload)

    remakes, extends = (derive.way(ways, state.offer) is not None for ways in (derive.REMAKES, derive.EXTENDS))

    # A route this bundle cannot serve answers 400 naming the kinds that can, and is left out of its document.
    @app.post("/v1/videos/{video_id}/remix", operation_id="remixVideo", summary="Remake a completed video with a new "
              "prompt (remixed_from_video_id names it)", include_in_schema=remakes,
              openapi_extra={"requestBody": oa.derived_request(state.offer, "remix")},
              responses={200: {"model": oa.Video, "description": "the new job, queued", "links": oa.VIDEO_LINKS},
                         **oa.errors(400, 404, 409, 413, 415, 429, 503, 507)})
    async def remix(request: Request, video_id: VideoId) -> JSONResponse:
        return await derived(request, "remix", video_id)

    @app.post("/v1/videos/edits", operation_id="editVideo", summary="Remake a video (an upload, or a completed one "
              "by id) with a new prompt", include_in_schema=remakes,
              openapi_extra={"requestBody": oa.derived_request(state.offer, "edit")},
              responses={200: {"model": oa.Video, "description": "the new job, queued", "links": oa.VIDEO_LINKS},
                         **oa.errors(400, 404, 409, 413, 415, 429, 503, 507)})
    async def edit(request: Request) -> JSONResponse:
        return await derived(request, "edit")

    @app.post("/v1/videos/extensions", operation_id="extendVideo", summary="Continue a video (an upload, or a "
              "completed one by id): the result is the video, then `seconds` more", include_in_schema=extends,
              openapi_extra={"requestBody": oa.derived_request(state.offer, "extend")},
              responses={200: {"model": oa.Video, "description": "the new job, queued", "links": oa.VIDEO_LINKS},
                         **oa.errors(400, 404, 409, 413, 415, 429, 503, 507)})
    async def extension(request: Request) -> JSONResponse:
        return await derived(request, "extend")


def _derive(state: State, store: JobStore, body: Body, tenant: str, op: str, ref: str | None,
            upload: bytes | None) -> JSONResponse:
    """A remix's, edit's or extension's job: its source (a completed video of the tenant's, or the upload), the
    create request derive.py makes of it, checked as any, and queued with the source among its files."""
    offer = state.offer
    with state.decodes:
        source = derive.load_source(store, tenant, ref, upload)
        made, extra, added = (derive.extend if op == "extend" else derive.remake)(body, offer, source)
        try:
            params = parse_request(made, offer, state.pipe, state.settings.magcache.to_json()
                                   if state.settings.magcache is not None else None,
                                   len(source.frames) if added["derive"].get("way") == "forcing" else None)
        except ApiError as e:  # what the source gave the job is the request's `video`
            if e.param in ("input_reference", "last_image"):
                e.param, e.message = "video", e.message.replace("input_reference", "the video")
            raise
    derive.finish(params, added, source, extra)
    files = [data for name in FILE_FIELDS for data in made.files.get(name, [])] + [data for _, data in extra]
    return _queue(state, params, files, tenant)


def _live_preview(store: JobStore, job: Job) -> Response:
    """A running job's latest preview (thumbnails.py) as a WebP at the video's size; 409 before its first step."""
    try:
        data = store.storage.read(store.preview_key(job))
    except (FileNotFoundError, OSError):
        raise ApiError(409, f"video {job.id} has no preview yet: its first denoising step has not finished (or this "
                            "model's latents have no preview map); poll again", code="video_not_ready") from None
    return Response(thumbnails.live(data, job.size), media_type="image/webp", headers={"Cache-Control": "no-store"})


def _playlist(store: JobStore, job: Job) -> str:
    """The stream's playlist as its attempt last wrote it, ended here if the job has ended (a worker that died, or
    lost its storage, before ending it); an empty one for a job no attempt has started (ended if it failed or was
    cancelled first); 404 for a completed job with none (made before the server kept streams)."""
    try:
        playlist = hls.Playlist.parse(store.storage.read(store.stream_key(job, hls.PLAYLIST)).decode())
    except (FileNotFoundError, OSError, ValueError):
        if job.status == "completed":
            raise ApiError(404, f"video {job.id} has no stream (it was made before this server kept streams): "
                                f"download it with GET /v1/videos/{job.id}/content") from None
        playlist = hls.Playlist()
    if job.status in ("completed", "failed"):
        playlist.ended = True
    return playlist.text()


def _derived_image(store: JobStore, job: Job, variant: str) -> Response:
    """A completed video's thumbnail (WebP) or spritesheet (JPEG), made from its mp4 and kept if it predates them."""
    thumbnail_key, spritesheet_key = derived_keys(job.video)  # type: ignore[arg-type]
    key = thumbnail_key if variant == "thumbnail" else spritesheet_key
    if not store.storage.exists(key):
        for k, data in zip((thumbnail_key, spritesheet_key), thumbnails.from_video(store.storage.read(job.video)),
                           strict=True):
            store.storage.put(k, data)
    media = "image/webp" if variant == "thumbnail" else "image/jpeg"
    ext = "webp" if variant == "thumbnail" else "jpg"
    return Response(store.storage.read(key), media_type=media,
                    headers={"Content-Disposition": f'attachment; filename="{job.id}.{variant}.{ext}"'})


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
