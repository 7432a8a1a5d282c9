"""The create request (`POST /v1/videos`): its fields, read from a JSON or multipart body and checked as the CLI
checks its flags, into the params of a job."""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from typing import Any

from .. import kinds
from ..errors import UserError
from .errors import ApiError
from .state import State

MAX_BODY_BYTES = 32 << 20  # a request (form fields and images)
MAX_IMAGE_BYTES = 20 << 20  # one image file
MAX_IMAGE_PIXELS = 40_000_000  # one image, decoded
MAX_PROMPT_CHARS = 20_000
MAX_STEPS = 1000  # per job: more would hold the one worker for hours
POLL_AFTER_MS = 250  # what the openai SDK's poll helpers wait between retrieves


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


async def _read_limited(request: Any) -> bytes:
    """The body, refusing more than MAX_BODY_BYTES as it streams in (chunked bodies have no Content-Length)."""
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise ApiError(413, f"request body larger than {MAX_BODY_BYTES >> 20} MB")
        chunks.append(chunk)
    return b"".join(chunks)


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

