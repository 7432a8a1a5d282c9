"""A create request's field (`Field`: its type, limits, enum and description make both the check a value goes
through and the JSON Schema /openapi.json documents) and what a server offers a request (`Offer`: the bundle's names,
shapes, kind and defaults, the server's limits), with the request's limits. The table of fields is request_fields.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import kinds
from ..manifest import Defaults, Manifest
from . import loras as lora_api
from .errors import ApiError
from .jsonnum import number as json_number

MAX_BODY_BYTES = 32 << 20  # a request (form fields and images)
MAX_VIDEO_BODY_BYTES = 256 << 20  # a request to a bundle that takes videos
MAX_IMAGE_BYTES = 20 << 20  # one image file
MAX_VIDEO_BYTES = 200 << 20  # one video file (a control or source video, a mask)
MAX_IMAGE_PIXELS = 40_000_000  # one image, decoded
MAX_VIDEO_PIXELS = 2_000_000_000  # one video, decoded: frames x width x height
MAX_PROMPT_CHARS = 20_000
MAX_STEPS = 1000  # per job: more would hold the one worker for hours (`serve --max-steps` lowers it)
# Every step count up to MAX_STEPS has a usable schedule at any flow shift in this range (tests/test_openapi.py
# checks its ends), so a request inside it never fails on its schedule.
FLOW_SHIFT = (0.01, 100.0)
SIGMA_MIN = 1e-6  # the smallest custom sigma: shifted by any flow shift in range it stays above float32's zero
MAX_FPS = 240
POLL_AFTER_MS = 250  # what the openai SDK's poll helpers wait between retrieves
MAX_FILES = 16  # file parts in one form
DEFAULT_MAX_SECONDS = 60.0  # diffusion forcing bundles: the longest video a job may ask for (`serve --max-seconds`)


def seconds_of(frames: int, fps: int) -> str:
    """A duration as the API writes it (`/v1/models`' shapes, `seconds`): frames / fps, shortest form."""
    return f"{frames / fps:g}"


@dataclass(frozen=True)
class Offer:
    """What this server makes, as a request may ask for it: the bundle's names, shapes, frame rate, kind and
    defaults, and the server's step limit. Read from the manifest, so the document is right while the weights load."""

    models: tuple[str, ...]  # what `model` may name: the bundle's directory name, then its bundle_id
    shapes: tuple[tuple[str, int], ...]  # (size, frames) of each shape, the default first
    kind: kinds.Kind
    defaults: Defaults
    max_steps: int = MAX_STEPS
    video_to_video: bool = False  # a text-to-video bundle that takes a source video (Manifest.video_to_video)
    reference_counts: tuple[int, ...] = (0,)  # VACE: the counts of reference images its programs serve
    loras: tuple[Any, ...] = ()  # the LoRA adapters offered (--lora-dir), runtime.lora.Adapter each
    max_loras: int = lora_api.MAX_LORAS  # the most adapters one request may name (--max-loras)
    max_seconds: float = DEFAULT_MAX_SECONDS  # diffusion forcing: the longest video a job may ask for
    tiny_decoder: bool = False  # the bundle has a tiny decoder (export --tiny-decoder): `decoder` is offered
    pyramid: int = 1  # a Helios pyramid's stages (manifest.Chunks.stages); 1 for every other bundle

    @classmethod
    def of(cls, manifest: Manifest, name: str, max_steps: int = MAX_STEPS, adapters: tuple[Any, ...] = (),
           max_loras: int = lora_api.MAX_LORAS, max_seconds: float = DEFAULT_MAX_SECONDS) -> Offer:
        kind = kinds.get(manifest.kind)
        # reference images a request sends (VACE's): a Wan-Animate 2 shape's one reference latent frame is the
        # character's slot, made from input_reference, not an upload of its own
        references = tuple(manifest.reference_counts) if kind.reference_images else (0,)
        return cls(models=tuple(dict.fromkeys((name, manifest.bundle_id))),
                   shapes=tuple(dict.fromkeys((g.size, g.frames) for g in manifest.shapes)),
                   kind=kind, defaults=manifest.defaults, max_steps=max_steps,
                   video_to_video=manifest.video_to_video, reference_counts=references,
                   loras=tuple(adapters), max_loras=max_loras, max_seconds=max_seconds,
                   tiny_decoder=manifest.tiny_decoder is not None,
                   pyramid=manifest.chunks.stages if manifest.chunks is not None else 1)

    @property
    def video_reference(self) -> bool:
        """input_reference is a video (VACE's control video, video-to-video's source, Lucy Edit's), not an image. (A
        diffusion forcing bundle's input_reference is the first frame; its videos to extend go to POST
        /v1/videos/extensions.)"""
        return self.kind.video in ("optional", "required") or self.video_to_video

    @property
    def takes_video(self) -> bool:
        """Some upload is a video (input_reference, Wan-Animate's pose and face videos, Wan-Animate 2's driving
        video)."""
        return self.video_reference or self.kind.animate or self.kind.animate2

    @property
    def max_body_bytes(self) -> int:
        """The largest create request read by default: room for a video upload where the bundle takes videos."""
        return MAX_VIDEO_BODY_BYTES if self.takes_video else MAX_BODY_BYTES

    @property
    def max_part_bytes(self) -> int:
        """The largest part of a multipart form: a video where the bundle takes videos, else an image."""
        return MAX_VIDEO_BYTES if self.takes_video else MAX_IMAGE_BYTES

    @property
    def sizes(self) -> list[str]:
        return list(dict.fromkeys(size for size, _ in self.shapes))

    @property
    def steps(self) -> int:
        """The steps a job runs when it asks for none: the bundle's default, or the server's limit if lower."""
        return min(self.defaults.steps, self.max_steps)

    def durations(self, size: str) -> dict[str, int]:
        """`size`'s durations at the bundle's frame rate (as /v1/models lists them), each to its frame count."""
        return {seconds_of(n, self.defaults.fps): n for s, n in self.shapes if s == size}



Bound = float | Callable[[Offer], float] | None


@dataclass(frozen=True)
class Field:
    """One field of the create request. `type` is "string", "integer", "number", "boolean" (in a form "true" or
    "false"), "numbers" (a JSON array of numbers, in a form their text joined by commas), "integers" (a JSON array of
    `max_items` integers in the bounds, in a form joined by commas, kept in order), "file" (a file part in a multipart
    form, a base64 data URL in JSON; `accepts` says what it holds, `repeat` how many times it may be sent) or "loras"
    (a list of LoRA entries, runtime/serve/loras.py)."""

    name: str
    type: str
    description: str
    param: str | None = None  # its name in the job's params (the run setting it feeds), if it goes there as is
    required: bool = False
    minimum: Bound = None
    maximum: Bound = None
    max_length: int | None = None
    pattern: str | None = None  # a string must contain a match (JSON Schema's `pattern`, as re.search)
    mismatch: str = ""  # the 400's message when the pattern or the enum refuses a value ({value!r}, {choices})
    enum: Callable[[Offer], list[str]] | None = None
    default: Callable[[Offer], Any] | None = None  # what an absent field means, as documented
    offered: Callable[[Offer], bool] = lambda offer: True  # whether this bundle takes the field at all
    refusal: Callable[[Offer], str] | None = None  # the 400's message when it is sent where not offered
    exclusive_minimum: bool = False  # the minimum itself is refused
    max_items: Bound = None  # "numbers": the most items
    accepts: Callable[[Offer], str] = lambda offer: "image"  # "file": "image" or "video"
    repeat: Callable[[Offer], int] | None = None  # "file": how many times it may be sent (None: once)

    def bounds(self, offer: Offer) -> tuple[float | None, float | None]:
        return tuple(b(offer) if callable(b) else b for b in (self.minimum, self.maximum))  # type: ignore[return-value]

    def what(self, offer: Offer) -> str:
        """What a valid value is, in words: "an integer in 1..1000"."""
        lo, hi = (b if isinstance(b, int) or b is None else f"{b:g}" for b in self.bounds(offer))
        what = "an integer" if self.type == "integer" else "a finite number"
        if self.exclusive_minimum and hi is not None:
            return f"{what} in ({lo}, {hi}]"
        if lo is not None and hi is not None:
            return f"{what} in {lo}..{hi}"
        return f"{what} >= {lo}" if lo is not None else what

    def schema(self, offer: Offer, form: bool) -> dict[str, Any]:
        """The field's JSON Schema in the request body of a JSON (form=False) or multipart (form=True) request."""
        if self.type == "loras":
            return lora_api.schema(offer, form, self.description)
        if self.type == "file":
            return file_schema(self.accepts(offer), self.description, form,
                               None if self.repeat is None else self.repeat(offer))
        if self.type == "boolean":
            if form:
                return {"type": "string", "enum": ["true", "false"], "description": self.description}
            return {"type": "boolean", "description": self.description}
        if self.type == "integers":  # exactly max_items of them; in a form, comma-separated
            lo, hi = self.bounds(offer)
            n = _bound(self.max_items, offer)
            if form:
                number = "(0|[1-9][0-9]{0,5})"  # as jsonnum.number reads a form's integer: no leading zeros
                return {"type": "string", "pattern": rf"^{number}(,{number}){{{n - 1}}}$",
                        "description": self.description}
            return {"type": "array", "items": {"type": "integer", "minimum": lo, "maximum": hi}, "minItems": n,
                    "maxItems": n, "description": self.description}
        if self.type == "numbers":  # in a form, the numbers as text, comma-separated
            lo, hi = self.bounds(offer)
            if form:
                return {"type": "string", "pattern": sigmas_text(_bound(self.max_items, offer)).pattern,
                        "description": self.description}
            item = {"type": "number", "minimum": lo, "maximum": hi}
            return {"type": "array", "items": item, "minItems": 1, "maxItems": _bound(self.max_items, offer),
                    "description": self.description}
        out: dict[str, Any] = {"type": self.type, "description": self.description}
        lo, hi = self.bounds(offer)
        low = "exclusiveMinimum" if self.exclusive_minimum else "minimum"
        min_length = 1 if self.pattern is not None else None  # a pattern asks for a character (said twice: fuzzers)
        out.update({k: v for k, v in ((low, lo), ("maximum", hi), ("minLength", min_length),
                                      ("maxLength", self.max_length),
                                      ("pattern", self.pattern)) if v is not None})
        if self.enum is not None:
            out["enum"] = self.enum(offer)
        if self.default is not None:
            out["default"] = self.default(offer)
        return out

    def check(self, value: Any, offer: Offer, form: bool) -> Any:
        """The value, checked against the field's type, limits and enum (a form field's text is read as JSON would
        read it); an ApiError(400) naming the field otherwise."""
        if self.type == "loras":
            return lora_api.check(value, offer, form)
        if self.type in ("integer", "number"):
            number = json_number(value, self.type == "integer", form)
            lo, hi = self.bounds(offer)
            if number is None or not math.isfinite(number) or (lo is not None and number < lo) or \
                    (hi is not None and number > hi) or (self.exclusive_minimum and number == lo):
                raise ApiError(400, f"{self.name} must be {self.what(offer)}, got {value!r}", self.name)
            if self.enum is not None and number not in self.enum(offer):
                raise ApiError(400, self.mismatch.format(value=value, choices=", ".join(map(str, self.enum(offer)))),
                               self.name)
            return number
        if self.type == "boolean":
            if form and value in ("true", "false"):
                return value == "true"
            if not form and isinstance(value, bool):
                return value
            raise ApiError(400, f"{self.name} must be true or false, got {value!r}", self.name)
        if self.type == "integers":
            lo, hi = self.bounds(offer)
            n = _bound(self.max_items, offer)
            items = value.split(",") if form and isinstance(value, str) else value
            numbers = [json_number(v, True, form) for v in items] if isinstance(items, list) else None
            if numbers is None or len(numbers) != n or any(v is None or isinstance(v, bool) or v < lo or v > hi
                                                           for v in numbers):
                what = f"{n} comma-separated integers" if form else f"a list of {n} integers"
                raise ApiError(400, f"{self.name} must be {what} in {lo}..{hi}, got {value!r}", self.name)
            return [int(v) for v in numbers]
        if self.type == "numbers":  # a form's text: comma-separated decimals (_SIGMAS_TEXT)
            text = sigmas_text(_bound(self.max_items, offer))
            items = [float(v) for v in value.split(",")] \
                if form and isinstance(value, str) and text.fullmatch(value) else None if form else value
            lo, hi = self.bounds(offer)
            if not isinstance(items, list) or not items or any(
                    (n := json_number(v, False, False)) is None or not math.isfinite(n) or n < lo or n > hi
                    for v in items):
                what = "comma-separated decimals" if form else "a list of numbers"
                raise ApiError(400, f"{self.name} must be {what} in {lo:g}..{hi:g}, got {value!r}", self.name)
            if len(items) > _bound(self.max_items, offer):  # counted as sent, as the document's maxItems counts
                raise ApiError(400, f"{self.name}: {len(items)} levels, more than this server runs "
                                    f"({_bound(self.max_items, offer)} steps)", self.name)
            return sorted({float(v) for v in items}, reverse=True)  # the distinct levels, run from the highest
        if not isinstance(value, str):
            raise ApiError(400, f"{self.name} must be a string, got {value!r}", self.name)
        if self.max_length is not None and len(value) > self.max_length:
            raise ApiError(400, f"{self.name} is longer than {self.max_length} characters", self.name)
        choices = self.enum(offer) if self.enum is not None else None
        if (self.pattern is not None and not re.search(self.pattern, value)) or \
                (choices is not None and value not in choices):
            raise ApiError(400, self.mismatch.format(value=value, choices=", ".join(choices or [])), self.name)
        return value


def file_schema(media: str, description: str, form: bool, repeat: int | None = None) -> dict[str, Any]:
    """A file field's JSON Schema: a binary part of a form, or in JSON a base64 data URL (format `image-data-url` or
    `video-data-url`: what the file must decode to, an image Pillow reads or a video with frames, is more than a
    pattern can say), an image also as OpenAI's {"image_url": "data:..."}; `repeat`: up to that many."""
    if form:
        one: dict[str, Any] = {"type": "string", "format": "binary", "description": description}
    else:
        url = {"type": "string", "format": f"{media}-data-url"}
        example = f"data:{media}/{'png' if media == 'image' else 'mp4'};base64,..."
        also = ', or {"image_url": DATA_URL}' if media == "image" else ""
        text = f"{description} In JSON: a base64 data URL ({example}) or bare base64{also} (the server fetches no URL)."
        one = {**url, "description": text} if media != "image" else {"anyOf": [url, {
            "type": "object", "properties": {"image_url": url}, "required": ["image_url"],
            "additionalProperties": False}], "description": text}
    if repeat is None or (form and repeat == 1):  # (a form's field sent at most once is a file, not a list)
        return one
    return {"type": "array", "items": {k: v for k, v in one.items() if k != "description"}, "maxItems": repeat,
            "description": description}


# A form's sigmas: decimals in SIGMA_MIN..1 with at most 6 places (1, 0.75, .000001), comma-separated, as JSON Schema
# (ECMA) and Python read the same pattern (`sigmas_text`: at most as many as the server runs steps).
_SIGMA = (r"(1(\.0{1,6})?|0?\.([1-9][0-9]{0,5}|0[1-9][0-9]{0,4}|00[1-9][0-9]{0,3}|000[1-9][0-9]{0,2}|0000[1-9][0-9]?"
          r"|00000[1-9]))")


def sigmas_text(most: int) -> re.Pattern[str]:
    return re.compile(f"^{_SIGMA}(,{_SIGMA}){{0,{most - 1}}}$")


def _bound(b: Bound, offer: Offer) -> Any:
    return b(offer) if callable(b) else b


# A character that is not white space as Python's str.isspace() (what check_prompt strips) says, spelled out: `\S` means
# other sets in JSON Schema's regular expressions (ECMA-262: not \x1c-\x1f and \x85, but \ufeff) and in Python's.
NOT_BLANK = r"[^\t\n\v\f\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
