"""Reading a request's body: JSON or a multipart form of at most so many bytes, its files decoded (data URLs in
JSON) and checked as images or videos the runtime reads, before any field is."""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from . import loras as lora_api
from .errors import ApiError
from .fields import (
    MAX_BODY_BYTES,
    MAX_FILES,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_VIDEO_BYTES,
    MAX_VIDEO_PIXELS,
    Offer,
)
from .request_fields import BY_NAME, FIELDS, FILE_FIELDS


@dataclass
class Body:
    """A create request as sent: its fields (files apart, as bytes, a list per field: reference_image repeats) and
    whether it came as a form (whose numbers are text)."""

    fields: dict[str, Any]
    files: dict[str, list[bytes]]
    form: bool



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


def check_video(name: str, data: bytes) -> list[Any]:
    """The frames of an uploaded video (mp4, webm, gif, ...); ApiError(400) naming the field if it is too large,
    not a video or empty."""
    if len(data) > MAX_VIDEO_BYTES:
        raise ApiError(400, f"{name} is larger than {MAX_VIDEO_BYTES >> 20} MB", name)
    try:
        frames = read_video_bytes(data, name)
    except UserError as e:
        raise ApiError(400, str(e), name) from None
    w, h = frames[0].size
    if len(frames) * w * h > MAX_VIDEO_PIXELS:
        raise ApiError(400, f"{name} has {len(frames)} frames of {w}x{h} pixels, more than this server reads", name)
    return frames


def read_video_bytes(data: bytes, what: str) -> list[Any]:
    """An uploaded video's frames (PIL images): written to a temporary file named for its container (GIF, WebM /
    Matroska, else MP4 / MOV) and read as a video file is (runtime/video_input.py)."""
    import tempfile
    from pathlib import Path

    from ..video_input import load_frames

    with tempfile.TemporaryDirectory(prefix="wan-aot-upload-") as tmp:
        path = Path(tmp) / f"{what}{video_suffix(data)}"
        path.write_bytes(data)
        frames = load_frames(path, what)
        return [f.copy() for f in frames]


def video_suffix(data: bytes) -> str:
    """The file name suffix an uploaded video's bytes are read under: its container's (GIF, WebM / Matroska), else
    .mp4 (MP4 / MOV), so that the reader picks the plugin for it."""
    return ".gif" if data[:4] == b"GIF8" else ".webm" if data[:4] == b"\x1a\x45\xdf\xa3" else ".mp4"


def decode_data_url(name: str, value: str) -> bytes:
    """JSON requests carry images as data URLs (data:image/png;base64,...) or bare base64."""
    payload = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{name} in a JSON request must be a base64 data URL (data:image/png;base64,...)",
                       name) from None


def decode_file(name: str, value: Any, image: bool) -> bytes:
    """A file field's value in JSON: a data URL string, or (an image) OpenAI's {"image_url": "data:..."}. The server
    fetches nothing: any other URL is a 400."""
    if image and isinstance(value, dict) and set(value) == {"image_url"} and isinstance(value["image_url"], str):
        url = value["image_url"]
        if not url.startswith("data:"):
            raise ApiError(400, f"{name}.image_url must be a data URL (data:image/png;base64,...): the server fetches "
                                "nothing, send the image's bytes", name)
        return decode_data_url(name, url)
    if not isinstance(value, str):
        shape = ' or {"image_url": "data:..."}' if image else ""
        raise ApiError(400, f"{name} must be a base64 data URL string{shape}", name)
    return decode_data_url(name, value)


async def read_limited(request: Any, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body, refusing more than `max_bytes` as it streams in (chunked bodies have no Content-Length)."""
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise ApiError(413, f"request body larger than {max_bytes / (1 << 20):g} MB (--max-body-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_text(fields: dict[str, Any]) -> None:
    """A 400 for text JSON can carry but UTF-8 cannot (a lone surrogate, "\\ud800"): nothing could store or echo
    it. Names the field it is in (its top-level name), at any depth."""
    stack: list[tuple[Any, str | None]] = [(fields, None)]
    while stack:
        value, name = stack.pop()
        if isinstance(value, dict):
            stack += [(item, name or key) for key, item in value.items()] + [(key, None) for key in value]  # keys first
        elif isinstance(value, list):
            stack += [(item, name) for item in value]
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{name or 'a field name'} is not valid Unicode text (it holds a lone surrogate, "
                                    "such as \\ud800): send UTF-8 text", name) from None


async def read_body(request: Any, max_bytes: int = MAX_BODY_BYTES, max_part_bytes: int = MAX_IMAGE_BYTES,
                    file_fields: tuple[str, ...] = FILE_FIELDS, offer: Offer | None = None) -> Body:
    """A JSON or multipart/form-data body of at most `max_bytes` (a form's parts of at most `max_part_bytes`), whose
    files are the fields `file_fields` (the create request's by default; in JSON, data URLs, or for an image
    {"image_url": "data:..."}, also sent in a form as the field `NAME[image_url]`; a JSON object for another field,
    such as an edit's {"video": {"id": ...}}, stays a field); any other media type is a 415."""
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    files: dict[str, list[bytes]] = {}

    def image(name: str) -> bool:
        return name in BY_NAME and (offer is None or BY_NAME[name].accepts(offer) == "image")

    if media == "application/json":
        try:
            fields = json.loads(await read_limited(request, max_bytes))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # ValueError: JSON's, and too many digits
            raise ApiError(400, f"the body is not valid JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "the body must be a JSON object")
        _check_text(fields)
        for name in file_fields:
            if name in fields:
                if name not in BY_NAME and isinstance(fields[name], dict):  # a reference to a video ({"id": ...})
                    continue
                value = fields.pop(name)
                repeated = name in BY_NAME and BY_NAME[name].repeat is not None
                items = value if repeated and isinstance(value, list) else [value]
                files[name] = [decode_file(name, v, image(name)) for v in items]
        return Body(fields, files, form=False)
    if media == "multipart/form-data":
        if request.headers.get("content-length") is None:  # chunked: bound it before the form parser reads it
            body = await read_limited(request, max_bytes)
            request._body = body  # Starlette parses the form from the cached body  # noqa: SLF001
        form = await request.form(max_files=MAX_FILES, max_fields=64, max_part_size=max_part_bytes)
        fields = {}
        for name, value in form.multi_items():
            if lora_api.form_part(name, value, fields):  # the openai SDK's lora[][name], lora[][scale] parts
                continue
            if name.endswith("[]") and BY_NAME.get(name[:-2], FIELDS[0]).type == "numbers":
                name = name[:-2]  # how the openai SDK sends a list in a form: one `sigmas[]` part an item
            if hasattr(value, "read"):  # an uploaded file
                if name not in file_fields:
                    where = " or ".join(file_fields) if file_fields != FILE_FIELDS else "input_reference"
                    raise ApiError(400, f"unexpected file field {name!r} (images and videos go in {where})", name)
                files.setdefault(name, []).append(await value.read())
            elif name in file_fields:
                files.setdefault(name, []).append(decode_data_url(name, value))
            elif name.endswith("[image_url]") and name[:-11] in file_fields and image(name[:-11]):
                # the SDK's form for extra_body={"input_reference": {"image_url": ...}}
                files.setdefault(name[:-11], []).append(decode_file(name[:-11], {"image_url": value}, True))
            elif name in fields and name in BY_NAME and BY_NAME[name].type == "numbers":  # a list sent as parts
                fields[name] = f"{fields[name]},{value}"
            elif name in fields:
                raise ApiError(400, f"{name} is sent twice", name)
            else:
                fields[name] = value
        return Body(fields, files, form=True)
    raise ApiError(415, f"unsupported content type {ctype or '(none)'!r}: send application/json or "
                        "multipart/form-data")
