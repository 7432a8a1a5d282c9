"""The OpenAI Images API's edits, `POST /v1/images/edits`, on an image-editing bundle (ChronoEdit:
kinds.Kind.chronoedit), as openai's `client.images.edit(image=open("in.png", "rb"), prompt=...)` calls it: a
multipart form in, an ImagesResponse out (`{"created", "data": [{"b64_json": PNG}], "output_format": "png", "size"}`).

The SDK waits for its answer (no polling: an image edit has no id of its own to poll), so the request is synchronous;
the edit itself is still a job of the queue, like a video job: the same tenants, turns, queue limits, lease and
cancel, run by whichever replica claims it (runtime/serve/run.py calls `run_edit`, which calls
`pipe.edit_image`). The request waits for that job's end, reading the job database (so any replica's worker may run
it), for at most `serve --max-sync-seconds`:

    completed      200, the PNG the job stored (its content: GET /v1/videos/{id}/content is that PNG too)
    cancelled      409 `cancelled` (POST /v1/videos/{id}/cancel or DELETE, the job being listed by GET /v1/videos)
    failed         500 with the job's error code (507 storage_full, 503 storage_unavailable)
    past the bound 504 `edit_timeout`, the job cancelled (nobody is left to take its image), saying how to raise it
    the client     gone before the end: the job is cancelled, so the one worker is not held for an unread answer
    a drain        (SIGTERM) while the job still waits: 503 `draining`, the job cancelled (this server takes none)

Every error answered once the job is queued carries `x-should-retry: false`: the SDK retries 409 and 5xx by default,
which here would queue the same edit again (or wait out the bound again) behind the caller's back.

Everything is checked before anything is queued or written (one-line 400s naming the field): the image (a file Pillow
reads: a video is refused), the prompt, `n` (1: one edit per request), `size` (one this bundle edits at, or `auto`),
`response_format` (`b64_json`: the server keeps no image to link to), `output_format` (`png`), and the extras
`negative_prompt`, `seed`, `num_inference_steps`, `guidance_scale` as the create request checks them
(schema.parse_request). Bundles of other kinds answer 404, and their documents leave the route out.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from pydantic import Field as PydanticField
from starlette.concurrency import run_in_threadpool

from . import intake
from . import openapi as oa
from .errors import ApiError
from .jobs import CANCELLED, Job
from .schema import BY_NAME, Body, Offer, _number, file_schema, parse_request, seconds_of

log = logging.getLogger("runtime")

TASK = "image_edit"  # a job's params["task"]: the worker runs `run_edit` and stores a PNG, not an mp4
# The edit shape's frames: runtime/chronoedit.py's EDIT_LATENT_FRAMES (2: the image's and the edit's) at the 4x
# temporal scale of Wan 2.1's VAE, ChronoEdit's (known from the offer, before the weights load: the document needs it)
EDIT_FRAMES = (2 - 1) * 4 + 1
IMAGE_FIELDS = ("image", "image[]")  # the SDK sends one file as `image`, a list as `image[]` parts
# The create request's fields an edit takes as they are (checked by schema.parse_request), beside the Images API's own.
EXTRAS = ("negative_prompt", "seed", "num_inference_steps", "guidance_scale")
OWN = ("prompt", "n", "size", "response_format", "output_format", "model", "user")
NO_RETRY = {"x-should-retry": "false"}
POLL_S = (0.05, 0.25)  # the wait's first and longest pause between reads of the job


def edits(offer: Offer) -> bool:
    """Whether this bundle edits images (its kind's row says so: kinds.Kind.chronoedit)."""
    return offer.kind.chronoedit


def edit_sizes(offer: Offer) -> list[str]:
    """The sizes this bundle edits at: those with an edit shape (EDIT_FRAMES frames), the default shape's first."""
    return list(dict.fromkeys(size for size, frames in offer.shapes if frames == EDIT_FRAMES))


class ImageData(BaseModel):
    model_config = ConfigDict(extra="forbid")
    b64_json: str = PydanticField(description="the edited image, a PNG, base64-encoded")


class ImagesResponse(BaseModel):
    """openai's ImagesResponse, as `client.images.edit` parses it."""

    model_config = ConfigDict(extra="forbid")
    created: int = PydanticField(description="when the edit was made (Unix seconds)")
    data: list[ImageData] = PydanticField(min_length=1, max_length=1)
    output_format: str = PydanticField(description="png")
    size: str = PydanticField(description="the image's WIDTHxHEIGHT: the bundle shape's")


def request_schema(offer: Offer) -> dict[str, Any]:
    """The edit request's body (multipart/form-data only, as the SDK sends it) for the OpenAPI document."""
    props: dict[str, Any] = {
        "image": file_schema("image", "The image to edit (PNG, JPEG, WebP, ...): resized to the size's shape as the "
                                      "pipeline does. One image.", True),
        "prompt": {**BY_NAME["prompt"].schema(offer, True), "description": "What to change in the image."},
        "n": {"type": "integer", "minimum": 1, "maximum": 1, "default": 1,
              "description": "How many edits: 1 (send the request again, with another seed, for another)."},
        "size": {"type": "string", "enum": [*edit_sizes(offer), "auto"], "default": "auto",
                 "description": "The edited image's WIDTHxHEIGHT: one this bundle edits at (GET /v1/models lists "
                                "its shapes); auto: the default shape's."},
        "response_format": {"type": "string", "enum": ["b64_json"], "default": "b64_json",
                            "description": "b64_json (the server keeps no image to link to: no url)."},
        "output_format": {"type": "string", "enum": ["png"], "default": "png", "description": "png."},
        "model": BY_NAME["model"].schema(offer, True),
        "user": {"type": "string", "maxLength": 256, "description": "The caller's end user (not used)."},
    }
    for name in EXTRAS:
        props[name] = BY_NAME[name].schema(offer, True)
    props["guidance_scale"]["default"] = offer.defaults.guidance
    schema = {"type": "object", "properties": props, "required": ["image", "prompt"], "additionalProperties": False}
    return {"required": True, "content": {"multipart/form-data": {"schema": schema,
                                                                   "encoding": {"image": {"contentType": "image/*"}}}}}


def add_routes(app: FastAPI, state: Any) -> None:
    """POST /v1/images/edits: documented on image-editing bundles, a 404 naming what does edit on the others."""
    offer = state.offer
    able = edits(offer)

    @app.post("/v1/images/edits", operation_id="editImage", include_in_schema=able,
              summary="Edit an image as the prompt says (OpenAI's images.edit): waits for the edit's job, up to "
                      "serve --max-sync-seconds",
              openapi_extra={"requestBody": request_schema(offer)} if able else None,
              responses={200: {"model": ImagesResponse, "description": "the edited image"},
                         **oa.errors(400, 409, 413, 415, 429, 500, 503, 504, 507)})
    async def edit(request: Request) -> JSONResponse:
        if not able:
            raise ApiError(404, f"this bundle is {offer.kind.title}: it makes videos (POST /v1/videos); image edits "
                                "(POST /v1/images/edits) are served for image-editing bundles (ChronoEdit)")
        intake.check_ready(state)  # the create route's checks, in its order
        tenant = request.state.tenant
        await run_in_threadpool(intake.check_room, state, tenant)
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "multipart/form-data":
            raise ApiError(415, f"unsupported content type {media or '(none)'!r}: send the image edit as "
                                "multipart/form-data (as the openai SDK's images.edit does)")
        with state.uploads.take():
            body = await intake.read(state, request, IMAGE_FIELDS)
            job = await run_in_threadpool(_queue, state, body, tenant)
        return await _wait(state, request, job)


def parse(body: Body, offer: Offer, pipe: Any, magcache: dict[str, Any] | None) -> tuple[dict[str, Any], bytes]:
    """(the job's params, the image) of an edit request, checked as a create request is; ApiError(400) naming the
    field otherwise (the image is `image`, never the create request's `input_reference`)."""
    for name in body.fields:
        if name not in OWN and name not in EXTRAS:
            raise ApiError(400, f"unknown field {name!r}: an image edit takes image, {', '.join(OWN)}, "
                                f"{', '.join(EXTRAS)}", name)
    images = [data for name in IMAGE_FIELDS for data in body.files.get(name, [])]
    if not images:
        raise ApiError(400, "image is required: the image to edit, a file part (PNG, JPEG, WebP, ...)", "image")
    if len(images) > 1:
        raise ApiError(400, f"{len(images)} images: a ChronoEdit bundle edits one image per request", "image")
    container = _video_container(images[0])
    if container is not None:
        raise ApiError(400, f"image is a video ({container}): an image edit takes one image (PNG, JPEG, WebP, ...)",
                       "image")
    fields = dict(body.fields)
    if "n" in fields and _number(fields.pop("n"), True, True) != 1:
        raise ApiError(400, f"n must be 1, got {body.fields['n']!r}: one edit per request (send it again, with "
                            "another seed, for another)", "n")
    response_format = fields.pop("response_format", "b64_json")
    if response_format != "b64_json":
        raise ApiError(400, f"response_format {response_format!r} is not served: this server answers b64_json only "
                            "(it keeps no image to link to)", "response_format")
    output_format = fields.pop("output_format", "png")
    if output_format != "png":
        raise ApiError(400, f"output_format {output_format!r} is not served: this server answers png only",
                       "output_format")
    user = fields.pop("user", "")
    if not isinstance(user, str) or len(user) > 256:
        raise ApiError(400, "user must be a string of at most 256 characters", "user")
    sizes = edit_sizes(offer)
    size = fields.pop("size", "auto")
    if size != "auto" and size not in sizes:
        raise ApiError(400, f"size {size!r} is not one this bundle edits at: it edits at {', '.join(sizes)} (or "
                            "auto)", "size")
    if not sizes:  # (export saw to this: a ChronoEdit bundle has its edit shape)
        raise ApiError(400, f"this bundle has no {EDIT_FRAMES}-frame shape to edit on", "size")
    fields["size"] = sizes[0] if size == "auto" else size
    try:
        params = parse_request(Body(fields, {"input_reference": images}, form=True), offer, pipe, magcache)
    except ApiError as e:  # the create request's names for the image
        if e.param == "input_reference":
            e.param, e.message = "image", e.message.replace("input_reference", "image")
        raise
    # the edit shape's frames (the job's `seconds` says them), whatever the size's default shape
    params.update(frames=EDIT_FRAMES, seconds=seconds_of(EDIT_FRAMES, params["fps"]), task=TASK)
    return params, images[0]


def _video_container(data: bytes) -> str | None:
    """The video container `data` starts as (an upload that is a video, which Pillow would call unreadable), or
    None. (An animated GIF is an image: its first frame is edited.)"""
    if data[4:8] == b"ftyp":
        return "mp4" if data[8:10] != b"qt" else "mov"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def _queue(state: Any, body: Body, tenant: str) -> Job:
    with state.decodes:  # the image decoded: a few at a time (--max-decodes)
        params, image = parse(body, state.offer, state.pipe,
                              state.settings.magcache.to_json() if state.settings.magcache is not None else None)
    job = intake.add_job(state, params, [image], tenant)  # 429, 507 as a create request's
    log.info("job %s: an image edit at %s, waited for by its request (up to %g s)", job.id, job.size,
             state.settings.max_sync_seconds)
    return job


async def _wait(state: Any, request: Request, job: Job) -> JSONResponse:
    """The edit's answer once its job ends (see the module's docstring for each end)."""
    store, bound = state.store, state.settings.max_sync_seconds
    deadline = time.monotonic() + bound
    pause = POLL_S[0]
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        while True:
            now = await run_in_threadpool(store.get, job.id)
            if now is None or now.status in ("completed", "failed"):
                return await run_in_threadpool(_answer, store, job, now)
            if gone.done():
                await run_in_threadpool(_give_up, store, job, "its client went away before it ended")
                return JSONResponse({}, status_code=499)  # (nobody reads it)
            if state.draining.is_set() and now.status == "queued":
                await run_in_threadpool(_give_up, store, job, "the server is draining")
                raise ApiError(503, f"the server is shutting down and did not start the image edit (job {job.id}, "
                                    "cancelled): retry on another instance", code="draining",
                               headers={"Retry-After": "5", **NO_RETRY})
            if time.monotonic() >= deadline:
                ended = await run_in_threadpool(_give_up, store, job, f"it did not end within {bound:g} s")
                if ended is not None:  # it ended as the bound passed: its own answer
                    return await run_in_threadpool(_answer, store, job, ended)
                raise ApiError(504, f"the image edit did not finish within {bound:g} s (serve --max-sync-seconds) and "
                                    f"was cancelled (job {job.id}): start the server with a larger --max-sync-seconds, "
                                    "or ask for fewer num_inference_steps", code="edit_timeout", headers=NO_RETRY)
            await asyncio.wait([gone], timeout=min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(POLL_S[1], pause * 2)
    finally:
        gone.cancel()


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (its connection closed): the body has been read, so what the server receives
    next is the disconnect (as Starlette's StreamingResponse listens for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _give_up(store: Any, job: Job, why: str) -> Job | None:
    """Cancel the job nobody will take the answer of; the job as it ended instead, if it ended first."""
    from .jobs import NotCancellable

    try:
        store.cancel(job.id, message=f"the image edit was cancelled: {why}")
    except NotCancellable:
        return store.get(job.id)
    log.info("job %s: the image edit was cancelled: %s", job.id, why)
    return None


def _answer(store: Any, job: Job, now: Job | None) -> JSONResponse:
    """The ended job's answer: its PNG (200), or its end as an error in the OpenAI shape."""
    if now is None:
        raise ApiError(409, f"the image edit's job {job.id} was deleted before it ended (DELETE /v1/videos/{job.id})",
                       code=CANCELLED, headers=NO_RETRY)
    if now.status == "failed" and now.error_code == CANCELLED:
        raise ApiError(409, f"the image edit was cancelled (job {job.id}: POST /v1/videos/{job.id}/cancel) before it "
                            "ended", code=CANCELLED, headers=NO_RETRY)
    if now.status == "failed":
        status = {"storage_full": 507, "storage_unavailable": 503}.get(now.error_code or "", 500)
        raise ApiError(status, f"the image edit failed (job {job.id}): {now.error_message or now.error_code}",
                       code=now.error_code or "generation_failed", headers=NO_RETRY)
    png = store.storage.read(now.video)
    return JSONResponse({"created": int(now.completed_at or now.created_at),
                         "data": [{"b64_json": base64.b64encode(png).decode()}], "output_format": "png",
                         "size": now.size})


def run_edit(pipe: Any, params: dict[str, Any], media: dict[str, Any], s: Any, magcache: Any,
             on_step: Any, on_stage: Any, on_preview: Any, check: Any, out: Any) -> np.ndarray:
    """An image edit job's run (run.run_job): `pipe.edit_image` on the job's image, with the job's progress,
    previews and cancel checks; the PNG written to `out` (None: not written); returns the edit as one frame
    (1, H, W, 3) in [0, 1], for the job's thumbnail."""
    check()
    image = pipe.edit_image(media["image"], params["prompt"], params["negative_prompt"], seed=s.seed, steps=s.steps,
                            guidance=s.guidance, size=params["size"], flow_shift=s.flow_shift, sampler=s.sampler,
                            sigmas=s.sigmas, progress=False, on_step=on_step, on_preview=on_preview,
                            magcache=magcache, decoder=params.get("decoder") or "full")
    on_stage("decode")
    if out is not None:
        image.save(out, format="PNG")
    return np.asarray(image.convert("RGB"), np.float32)[None] / 255.0
