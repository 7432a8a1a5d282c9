"""The API's OpenAPI document (`GET /openapi.json`), as the server answers: the create request's body from the field
table (schema.py) for JSON and multipart, every response's schema and media type, every error in the OpenAI shape,
the bearer key where the server has one, and links from a created video to the operations on it.

The response models here only describe: handlers return plain dicts (the job store's `to_api`, `model_card`), and
the suite holds both to this document by running schemathesis against a live server (tests/test_openapi.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .schema import BY_NAME, FILE_FIELDS, NOT_BOTH_STEP_COUNTS, Offer, body_schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Strict):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None


class Error(_Strict):
    """Every error the API answers (4xx and 5xx), in the OpenAI shape."""

    error: ErrorDetail


class VideoError(_Strict):
    code: str
    message: str


class Video(_Strict):
    """A job: the OpenAI video object."""

    id: str
    object: Literal["video"]
    created_at: int
    completed_at: int | None
    status: Literal["queued", "in_progress", "completed", "failed"]
    model: str
    progress: int = Field(ge=0, le=100)
    size: str
    seconds: str = Field(description="the video's duration: its frames at the request's fps")
    prompt: str
    error: VideoError | None
    remixed_from_video_id: str | None = Field(description="the video this one was made from (remix, edits and "
                                                          "extensions of a completed video)")


class VideoList(_Strict):
    object: Literal["list"]
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(_Strict):
    id: str
    object: Literal["video.deleted"]
    deleted: bool


class Shape(_Strict):
    size: str
    frames: int
    seconds: str = Field(description="frames at the bundle's fps: a value `seconds` takes")
    default: bool
    reference_images: int = Field(description="VACE: the reference images this shape's programs take (0 else)")


class Lora(_Strict):
    """A LoRA adapter a request may name in `lora` (serve --lora-dir)."""

    name: str = Field(description="what `lora` entries name it by (its file name without .safetensors)")
    rank: int = Field(description="the largest rank of its layers")
    experts: list[str] = Field(description="the experts it changes: `transformer` on one-expert bundles, `high` / "
                                           "`low` on two-expert ones (an entry's `expert` may apply it to the other)")
    tensors: int = Field(description="how many of the bundle's tensors it changes")


class Defaults(_Strict):
    """What a request that leaves these out runs with (the bundle's, from its checkpoint or `--defaults`)."""

    steps: int
    guidance: float
    guidance_2: float | None
    flow_shift: float
    sampler: Literal["unipc", "euler", "dpm++", "flowmap"]  # samplers.SAMPLERS
    sigmas: list[float] | None


class Model(_Strict):
    """The bundle served, with what a request may ask of it."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    bundle_id: str
    kind: str
    title: str
    image: Literal["none", "optional", "required"]
    last_image: bool
    video: bool = Field(description="takes a control or source video (input_reference)")
    mask: bool = Field(description="takes a mask video (VACE)")
    animate: bool = Field(description="Wan-Animate: takes pose_video and face_video (and for replace "
                                      "background_video, mask_video); the video is as long as the pose video")
    animate_2: bool = Field(description="Wan-Animate 2: takes driving_video (and the character as input_reference); "
                                        "the video is as long as the driving video at the request's fps, at the "
                                        "image's aspect (`size` is an area)")
    forcing: bool = Field(description="diffusion forcing (SkyReels-V2 DF): `seconds` of any duration up to "
                                      "max_seconds, made in overlapping segments; extends videos")
    helios: bool = Field(description="Helios: `seconds` of any duration up to max_seconds, made in chunks of the "
                                     "size's shape, each on the ones before")
    image_edit: bool = Field(description="edits images: POST /v1/images/edits (ChronoEdit)")
    edit_sizes: list[str] | None = Field(None, description="image-editing bundles: the sizes an image edit may ask "
                                                           "for (absent for other kinds)")
    pyramid: int | None = Field(None, description="Helios: the stages of its pyramid (1: HeliosPipeline); absent "
                                                  "for other kinds")
    max_seconds: float | None = Field(None, description="diffusion forcing and Helios: the longest video a job may "
                                                        "ask for (serve --max-seconds); absent for other kinds")
    reference_images: list[int] = Field(description="the counts of reference images it serves (VACE; [0] else)")
    video_to_video: bool
    experts: int
    fps: int
    defaults: Defaults
    dtype: str
    quantize: str | None
    shapes: list[Shape]
    loras: list[Lora] = Field(description="the LoRA adapters the caller may name in `lora` ([] where none is offered)")
    max_loras: int = Field(description="the most adapters one request may name")


class ModelList(_Strict):
    object: Literal["list"]
    data: list[Model]


class Health(_Strict):
    status: Literal["ok"]


class Ready(_Strict):
    status: Literal["ready", "loading", "draining", "failed", "database_unavailable"]
    model: str | None = None
    bundle_id: str | None = None
    error: str | None = None


_WHY = {400: "a field, parameter or body the API does not take (`param` names it), a Host that is not this server's, "
             "a cross-origin Origin, or a malformed request",
        401: "missing or wrong API key", 404: "no such video (or another tenant's)",
        408: "the request's head or body did not arrive in time (--header-timeout, --body-timeout)",
        409: "the video (or its source) is not in a state for this; an image edit's job was cancelled",
        413: "the body is larger than the server takes (--max-body-mb)",
        415: "a body neither JSON nor multipart/form-data", 416: "a Range outside the video",
        429: "the queue is full", 431: "the request's head is too large",
        500: "a bug (`internal_error`), or an image edit's job failed (`code` says how, the message why)",
        504: "the image edit did not end within serve --max-sync-seconds: its job was cancelled",
        503: "the model is still loading, the server is draining, it is at a limit (--max-connections, "
             "--max-uploads), or the job database or video store cannot be reached now (`code` "
             "database_unavailable, storage_unavailable)",
        507: "the server's storage is full: nothing was queued"}
_HEADERS = {
    401: {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
    416: {"Content-Range": {"required": True, "description": "bytes */SIZE", "schema": {"type": "string"}}},
    429: {"Retry-After": {"required": True, "description": "seconds, about one job's time",
                          "schema": {"type": "integer"}}},
    503: {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}},
    507: {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}},
}
# What any request may be answered before it reaches its route (access.py, limits.py, the body limit).
ANY_ROUTE = (400, 408, 413, 431, 503)


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` for these error codes, each in the OpenAI error shape."""
    return {code: {"model": Error, "description": _WHY[code], **({"headers": _HEADERS[code]} if code in _HEADERS
                                                                 else {})} for code in codes}


def create_request(offer: Offer) -> dict[str, Any]:
    """The create request's body, for JSON and multipart forms."""
    form = body_schema(offer, form=True)
    images = {name: {"contentType": f"{BY_NAME[name].accepts(offer)}/*"} for name in FILE_FIELDS
              if name in form["properties"]}
    return {"required": True, "content": {"application/json": {"schema": body_schema(offer, form=False)},
                                          "multipart/form-data": {"schema": form, "encoding": images}}}


def derived_request(offer: Offer, op: str) -> dict[str, Any]:
    """The request body of a remix ("remix": JSON, as the SDK sends it), an edit ("edit") or an extension ("extend"):
    JSON with `video` as {"id": ...} or a data URL, or a form with `video` (a file) or `video[id]`."""
    from .derive import DEFAULT_STRENGTH, REMAKES, offered, way
    from .schema import SECONDS, file_schema

    names = offered(op, offer)
    uploads = op == "extend" or not getattr(way(REMAKES, offer), "settings_only", True)  # else ids only
    bodies: dict[str, Any] = {}
    for form in (False, True) if op != "remix" else (False,):
        props = {name: BY_NAME[name].schema(offer, form) for name in names}
        if "strength" in props:
            props["strength"]["default"] = DEFAULT_STRENGTH
        if "seconds" in props and offer.kind.any_length:  # the new part's: any duration (diffusion forcing, Helios)
            props["seconds"]["pattern"] = SECONDS
        elif "seconds" in props:  # the new part's: a duration of the size (the source's, unless `size` says)
            props["seconds"]["enum"] = list(dict.fromkeys(s for size in offer.sizes for s in offer.durations(size)))
        required = ["prompt"] + (["seconds"] if op == "extend" else [])
        schema: dict[str, Any] = {"type": "object", "properties": props, "required": required,
                                  "additionalProperties": False, **NOT_BOTH_STEP_COUNTS}
        if op != "remix":
            what = "The source video: a completed video of yours" + (", or a video file" if uploads else "")
            ref = {"type": "object", "properties": {"id": {"type": "string", "minLength": 1}}, "required": ["id"],
                   "additionalProperties": False}
            if form:
                props["video[id]"] = {"type": "string", "minLength": 1, "description": "A completed video's id (the "
                                      "SDK sends extra_body={\"video\": {\"id\": ...}} so)."}
                if uploads:
                    props["video"] = file_schema("video", what + " (the file).", True)
                    schema["allOf"] = [NOT_BOTH_STEP_COUNTS, {"oneOf": [{"required": ["video"]},
                                                                        {"required": ["video[id]"]}]}]
                    del schema["anyOf"]
                else:
                    required.append("video[id]")
            else:
                props["video"] = {"anyOf": [ref, {"type": "string", "format": "video-data-url"}] if uploads else [ref],
                                  "description": what + (': {"id": VIDEO_ID}, or a base64 data URL.' if uploads else
                                                         ': {"id": VIDEO_ID}.')}
                required.append("video")
        bodies["multipart/form-data" if form else "application/json"] = {"schema": schema}
    if "multipart/form-data" in bodies and uploads:
        bodies["multipart/form-data"]["encoding"] = {"video": {"contentType": "video/*"}}
    return {"required": True, "content": bodies}


VIDEO_LINKS = {op: {"operationId": op, "parameters": {"video_id": "$response.body#/id"}}
               for op in ("retrieveVideo", "downloadVideoContent", "deleteVideo", "cancelVideo")}


def finish(doc: dict[str, Any], keyed: bool) -> dict[str, Any]:
    """FastAPI's document, made to say what the server does: no 422 (a bad parameter is a 400 in the OpenAI shape),
    the errors any request may get before its route (ANY_ROUTE), and, where the server has a key, the bearer scheme
    and the 401 on every /v1/ operation."""
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            for code, response in errors(*ANY_ROUTE).items():
                if str(code) not in operation["responses"]:
                    operation["responses"][str(code)] = {
                        "description": response["description"], **({"headers": response["headers"]} if
                                                                   "headers" in response else {}),
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            if keyed and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = {
                    "description": _WHY[401], "headers": _HEADERS[401],
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if keyed:
        doc.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "the server's --api-key"}}
    return doc
