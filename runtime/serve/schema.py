"""The create request, `POST /v1/videos`: one table of its fields (FIELDS), read from a JSON or multipart body and
checked as the CLI checks its flags, into the params of a job.

The table is the one place a field is defined: its type, limits, enum and description make both the checks a
request goes through (`parse_request`) and the request body /openapi.json documents (`body_schema`), so the two
cannot drift apart (the suite runs schemathesis against the live document to hold them to it). What depends on the
bundle (its names, sizes and durations, the images its kind takes, a second expert's guidance) comes from an Offer,
read from the manifest before the weights load. A new field is one more Field in FIELDS; the job's params carry it
under `param`, for the worker to use.

The rules one field cannot state alone are kept beside the schema that states them: `seconds` is one of the
durations of the request's `size` (`_frames`, `_seconds_schema`), and the images a kind needs
(`kinds.check_images`; `required` in the document).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import animate, forcing, helios, kinds, samplers
from ..errors import UserError
from ..manifest import Defaults, Manifest
from ..settings import MAX_SEED
from . import loras as lora_api
from .errors import ApiError

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
        return cls(models=tuple(dict.fromkeys((name, manifest.bundle_id))),
                   shapes=tuple(dict.fromkeys((g.size, g.frames) for g in manifest.shapes)),
                   kind=kinds.get(manifest.kind), defaults=manifest.defaults, max_steps=max_steps,
                   video_to_video=manifest.video_to_video, reference_counts=tuple(manifest.reference_counts),
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
        """Some upload is a video (input_reference, or Wan-Animate's pose and face videos)."""
        return self.video_reference or self.kind.animate

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
                number = "(0|[1-9][0-9]{0,5})"  # as _number reads a form's integer: no leading zeros
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
            number = _number(value, self.type == "integer", form)
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
            numbers = [_number(v, True, form) for v in items] if isinstance(items, list) else None
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
                    (n := _number(v, False, False)) is None or not math.isfinite(n) or n < lo or n > hi
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


_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def _number(value: Any, integer: bool, form: bool) -> float | int | None:
    """A JSON number (or a form field's text in JSON's number syntax) as int or float; None if it is not one, or
    not a whole number where an integer is asked for."""
    if form and isinstance(value, str):
        try:
            value = int(value) if _INTEGER.fullmatch(value) else float(value) if _NUMBER.fullmatch(value) else None
        except (ValueError, OverflowError):  # more digits than Python converts
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if integer and isinstance(value, float):
        return int(value) if value.is_integer() else None
    return value


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


def _two_experts(offer: Offer) -> bool:
    return offer.kind.experts > 1


def _helios(name: str, type_: str, description: str, pyramid: bool = False, **kw: Any) -> Field:
    """A Helios setting by diffusers' name (runtime/helios.py takes it as is); `pyramid`: HeliosPyramidPipeline's."""
    def offered(o: Offer) -> bool:
        return o.kind.helios and (o.pyramid > 1 or not pyramid)

    what = "a Helios pyramid (HeliosPyramidPipeline)" if pyramid else "Helios models"
    return Field(name, type_, "Helios: " + description, param=name, offered=offered,
                 refusal=lambda o: f"{name} is for {what}; this bundle is {o.kind.title}", **kw)


HELIOS_FIELDS = (  # helios.SETTINGS, each a field
    _helios("add_noise_to_image_latents", "boolean", "lightly noise the first frame's latents first (default true).",
            default=lambda o: True),
    _helios("image_noise_sigma_min", "number", "that noise's least sigma.", minimum=0, maximum=1,
            default=lambda o: helios.NOISE_RANGE[0]),
    _helios("image_noise_sigma_max", "number", "that noise's greatest sigma.", minimum=0, maximum=1,
            default=lambda o: helios.NOISE_RANGE[1]),
    _helios("add_noise_to_video_latents", "boolean", "lightly noise the continued video's latents (default true).",
            default=lambda o: True),
    _helios("video_noise_sigma_min", "number", "that noise's least sigma.", minimum=0, maximum=1,
            default=lambda o: helios.NOISE_RANGE[0]),
    _helios("video_noise_sigma_max", "number", "that noise's greatest sigma.", minimum=0, maximum=1,
            default=lambda o: helios.NOISE_RANGE[1]),
    _helios("is_skip_first_chunk", "boolean", "the second chunk's first frame becomes the video's first frame.",
            default=lambda o: False),
    _helios("pyramid_num_inference_steps_list", "integers", "the steps of each pyramid stage (default "
            "num_inference_steps for each); they count against the server's step limit per chunk.", pyramid=True,
            minimum=1, maximum=lambda o: o.max_steps, max_items=lambda o: o.pyramid),
    _helios("is_cfg_zero_star", "boolean", "CFG-Zero* guidance (default: the bundle's).", pyramid=True),
    _helios("use_zero_init", "boolean", "CFG-Zero*: the first steps predict zero (default true).", pyramid=True,
            default=lambda o: True),
    _helios("zero_steps", "integer", "CFG-Zero*: the steps 0 .. zero_steps predict zero (default 1).", pyramid=True,
            minimum=0, maximum=lambda o: o.max_steps, default=lambda o: 1),
    _helios("is_amplify_first_chunk", "boolean", "a distilled model's first chunk at twice the steps.", pyramid=True,
            default=lambda o: False),
)


FIELDS: tuple[Field, ...] = (
    Field("prompt", "string", "What the video shows.", param="prompt", required=True,
          max_length=MAX_PROMPT_CHARS, pattern=NOT_BLANK, mismatch="prompt is required (a non-empty string)"),
    Field("negative_prompt", "string", "What the video should not show.", param="negative_prompt",
          max_length=MAX_PROMPT_CHARS, default=lambda o: ""),
    Field("model", "string", "The bundle served here, by its directory name or its bundle_id (GET /v1/models).",
          enum=lambda o: list(o.models), default=lambda o: o.models[0],
          mismatch="model {value!r} is not served here: this server runs {choices} (or leave model out)"),
    Field("size", "string", "Width x height, one of the bundle's resolutions (GET /v1/models lists its shapes).",
          param="size", enum=lambda o: o.sizes, default=lambda o: o.sizes[0],
          mismatch="size {value!r} is not one this bundle makes: it makes {choices}"),
    Field("seconds", "string", "The duration, one of those GET /v1/models lists for the size (frames at the "
          "bundle's frame rate); left out, the default shape's frame count. `fps` sets the rate the mp4 plays at, "
          "not the frame count. Diffusion forcing bundles make any duration up to the server's max_seconds (GET "
          "/v1/models), in overlapping segments of the size's longest shape; Helios bundles too, in chunks of the "
          "size's shape (rounded up to whole chunks).", offered=lambda o: not o.kind.animate,
          refusal=lambda o: "a Wan-Animate video is as long as its pose video: leave seconds out"),
    Field("input_reference", "file", "The first frame (image-to-video bundles; PNG, JPEG, WebP, ...), the "
          "character (Wan-Animate bundles), or the control or source video (VACE and video-to-video bundles, and "
          "Lucy Edit bundles, which need it: the video to edit; mp4, webm, gif): its frame count picks the video's "
          "frames.",
          offered=lambda o: o.kind.image != "none" or o.takes_video,
          accepts=lambda o: "video" if o.video_reference else "image",
          refusal=lambda o: f"this bundle is {o.kind.title}: it takes no image or video (export an image-to-video, "
                            "VACE or video-to-video model for that)"),
    Field("last_image", "file", "The last frame (first-last-frame and diffusion forcing bundles).",
          offered=lambda o: o.kind.takes_last_image,
          refusal=lambda o: f"this bundle is {o.kind.title}: it takes no last image (that needs a "
                            "first-last-frame model such as Wan2.1-FLF2V)"),
    Field("mask", "file", "VACE: the mask video, white = generate, black = keep (one frame per video frame).",
          offered=lambda o: o.kind.vace, accepts=lambda o: "video",
          refusal=lambda o: f"this bundle is {o.kind.title}: it takes no mask (masks are for VACE models)"),
    Field("reference_image", "file", "VACE: a reference image (repeat the field for several; the bundle serves the "
          "counts GET /v1/models lists).", offered=lambda o: o.kind.reference_images and max(o.reference_counts) > 0,
          repeat=lambda o: max(o.reference_counts),
          refusal=lambda o: f"this bundle is {o.kind.title}: it takes no reference images"),
    Field("pose_video", "file", "Wan-Animate: the rendered pose video the character follows (mp4, webm, gif); the "
          "video is as long, made in segments of the size's frames.", offered=lambda o: o.kind.animate,
          accepts=lambda o: "video", refusal=lambda o: f"pose_video is for Wan-Animate; this bundle is {o.kind.title}"),
    Field("face_video", "file", "Wan-Animate: the face crops, one per pose frame.", offered=lambda o: o.kind.animate,
          accepts=lambda o: "video", refusal=lambda o: f"face_video is for Wan-Animate; this bundle is {o.kind.title}"),
    Field("mode", "string", "Wan-Animate: animate (the character moves as the pose video says) or replace (the "
          "character takes the place of the person in background_video, where mask_video is white).", param="mode",
          enum=lambda o: list(animate.MODES), default=lambda o: "animate", offered=lambda o: o.kind.animate,
          mismatch="mode {value!r} is not one of {choices}",
          refusal=lambda o: f"mode is for Wan-Animate; this bundle is {o.kind.title}"),
    Field("background_video", "file", "Wan-Animate, replace: the video without the person, one frame per pose frame.",
          offered=lambda o: o.kind.animate, accepts=lambda o: "video",
          refusal=lambda o: f"background_video is for Wan-Animate; this bundle is {o.kind.title}"),
    Field("mask_video", "file", "Wan-Animate, replace: white where the character goes, one frame per pose frame.",
          offered=lambda o: o.kind.animate, accepts=lambda o: "video",
          refusal=lambda o: f"mask_video is for Wan-Animate; this bundle is {o.kind.title}"),
    Field("prev_segment_frames", "integer", "Wan-Animate: the frames each segment takes from the one before.",
          param="prev_segment_frames", default=lambda o: 1,  # those a segment of the bundle's frames can take
          enum=lambda o: [p for p in animate.PREV_FRAMES if any(n >= 2 * p + 1 for _, n in o.shapes)],
          offered=lambda o: o.kind.animate, mismatch="prev_segment_frames must be one of {choices}, got {value!r}",
          refusal=lambda o: f"prev_segment_frames is for Wan-Animate; this bundle is {o.kind.title}"),
    Field("overlap_history", "integer", "Diffusion forcing: the frames each segment takes from the one before.",
          param="overlap_history", minimum=1, maximum=lambda o: max(n for _, n in o.shapes) - 1,
          default=lambda o: forcing.DEFAULT_OVERLAP, offered=lambda o: o.kind.forcing,
          refusal=lambda o: f"overlap_history is for diffusion forcing models; this bundle is {o.kind.title}"),
    Field("ar_step", "integer", "Diffusion forcing, the asynchronous mode: each causal block of frames starts this "
          "many steps after the one before (0: all at once). Needs causal_block_size.", param="ar_step", minimum=0,
          maximum=lambda o: o.max_steps, default=lambda o: 0, offered=lambda o: o.kind.forcing,
          refusal=lambda o: f"ar_step is for diffusion forcing models; this bundle is {o.kind.title}"),
    Field("causal_block_size", "integer", "Diffusion forcing: latent frames per causal block of block-causal "
          "attention; must divide every segment's latent frames.", param="causal_block_size", minimum=1,
          maximum=lambda o: max(n for _, n in o.shapes), offered=lambda o: o.kind.forcing,
          refusal=lambda o: f"causal_block_size is for diffusion forcing models; this bundle is {o.kind.title}"),
    Field("addnoise_condition", "number", "Diffusion forcing: re-noise the frames carried over between segments to "
          "this timestep (20 is diffusers' recommendation).", param="addnoise_condition", minimum=0, maximum=999,
          default=lambda o: 0, offered=lambda o: o.kind.forcing,
          refusal=lambda o: f"addnoise_condition is for diffusion forcing models; this bundle is {o.kind.title}"),
    *HELIOS_FIELDS,
    Field("conditioning_scale", "number", "VACE: the scale of the VACE branch's hints.", param="conditioning_scale",
          minimum=0, maximum=100, default=lambda o: 1.0, offered=lambda o: o.kind.vace,
          refusal=lambda o: f"conditioning_scale is for VACE models; this bundle is {o.kind.title}"),
    Field("strength", "number", "Video-to-video: how much of the source video is replaced (the steps after the "
          "first int(steps x (1 - strength)) run).", param="strength", minimum=0, maximum=1, exclusive_minimum=True,
          default=lambda o: 0.8, offered=lambda o: o.video_to_video,
          refusal=lambda o: f"strength is for video-to-video bundles; this bundle is {o.kind.title}"),
    Field("seed", "integer", "The noise seed (jax.random).", param="seed", minimum=0, maximum=MAX_SEED,
          default=lambda o: 0),
    Field("num_inference_steps", "integer", "Denoising steps.", param="steps", minimum=1,
          maximum=lambda o: o.max_steps, default=lambda o: o.steps),
    Field("guidance_scale", "number", "Classifier-free guidance scale.", param="guidance", minimum=0,
          default=lambda o: o.defaults.guidance),
    Field("guidance_scale_2", "number", "The second (low-noise) expert's guidance scale (default: "
          "guidance_scale).", param="guidance_2", minimum=0, offered=_two_experts,
          refusal=lambda o: f"guidance_scale_2 is for two-expert models; this bundle is {o.kind.title} with one "
                            "expert: use guidance_scale"),
    Field("flow_shift", "number", "The scheduler's flow shift.", param="flow_shift", minimum=FLOW_SHIFT[0],
          maximum=FLOW_SHIFT[1], default=lambda o: o.defaults.flow_shift),
    Field("sampler", "string", "The sampler: unipc (UniPCMultistepScheduler), euler (FlowMatchEulerDiscreteScheduler) "
          "or dpm++ (DPMSolverMultistepScheduler); flowmap (FlowMapEulerDiscreteScheduler) on flow-map models (AnyFlow), "
          "which take flowmap or euler only.", param="sampler", enum=lambda o: list(samplers.samplers_for(o.kind.flow_map)),
          default=lambda o: o.defaults.sampler, mismatch="sampler {value!r} is not one of {choices}"),
    Field("sigmas", "numbers", "Custom noise levels before the flow shift (e.g. 1, 0.75, 0.5, 0.25), one step per "
          "distinct level, run from the highest down (so any order): they set the step count, so "
          "num_inference_steps is left out. In a form: comma-separated decimals.",
          param="sigmas", minimum=SIGMA_MIN, maximum=1, max_items=lambda o: o.max_steps),
    Field("decoder", "string", "What decodes the video: full (the VAE) or tiny (the bundle's tiny decoder: several "
          "times faster, coarser).", param="decoder", enum=lambda o: ["full", "tiny"], default=lambda o: "full",
          mismatch="decoder {value!r} is not one of {choices}", offered=lambda o: o.tiny_decoder,
          refusal=lambda o: "this bundle has no tiny decoder (export it with --tiny-decoder FILE): leave decoder out"),
    Field("fps", "integer", "The frame rate the mp4 plays at.", param="fps", minimum=1, maximum=MAX_FPS,
          default=lambda o: o.defaults.fps),
    Field("lora", "loras", "LoRA adapters to run with, from those GET /v1/models lists: each {\"name\", \"scale\"} "
          "(scale in -4..4, default 1), on two-expert bundles with \"expert\": \"high\" or \"low\" (default: the "
          "experts the adapter was made for); left out, none.", param="lora", offered=lambda o: bool(o.loras),
          refusal=lambda o: "this server offers no LoRA adapters (start it with --lora-dir DIR)"),
)
BY_NAME = {f.name: f for f in FIELDS}
FILE_FIELDS = tuple(f.name for f in FIELDS if f.type == "file")


# -- the document ----------------------------------------------------------------
def body_schema(offer: Offer, form: bool) -> dict[str, Any]:
    """The create request's body as JSON Schema: a JSON object (form=False) or a multipart form (form=True)."""
    fields = [f for f in FIELDS if f.offered(offer)]
    required = [f.name for f in fields if f.required]
    if offer.kind.image == "required":  # the first image, and the last for first-last-frame bundles
        required += ["input_reference"] + (["last_image"] if offer.kind.last_image else [])
    if offer.kind.video == "required":  # the source video (Lucy Edit)
        required += ["input_reference"]
    if offer.kind.animate:
        required += ["pose_video", "face_video"]
    schema: dict[str, Any] = {"type": "object", "properties": {f.name: f.schema(offer, form) for f in fields},
                              "required": required, "additionalProperties": False}
    # The rules between fields, as alternatives (anyOf, all of them holding: allOf) rather than not / if-then-else,
    # which fuzzers' generators work around by validating what they drew (schemathesis cannot validate file parts).
    rules = [NOT_BOTH_STEP_COUNTS]  # sigmas set the step count: a request gives one or the other
    if offer.kind.any_length:  # any duration up to the server's limit, checked against the run's plan at once
        schema["properties"]["seconds"]["pattern"] = SECONDS
    elif "seconds" in schema["properties"]:
        rules.append(_seconds_schema(offer, schema["properties"]["seconds"]))
    if offer.kind.animate:  # replace takes a background and a mask video, animate neither
        rules.append({"anyOf": [
            {"properties": {"mode": {"const": "animate"}, "background_video": False, "mask_video": False}},
            {"properties": {"mode": {"const": "replace"}}, "required": ["mode", "background_video", "mask_video"]}]})
    schema["allOf"] = [r for r in rules if r]
    return schema


SECONDS = r"^[0-9]{1,6}(\.[0-9]{1,6})?$"  # a diffusion forcing bundle's durations: a decimal number of seconds
NOT_BOTH_STEP_COUNTS = {"anyOf": [{"properties": {"sigmas": False}}, {"properties": {"num_inference_steps": False}}]}


def _seconds_schema(offer: Offer, seconds: dict[str, Any]) -> dict[str, Any]:
    """`seconds`' values: those of the size asked for (the default size's when size is left out). Where every size
    comes in the same durations that is an enum; otherwise one branch per size (size absent matches the first)."""
    durations = {size: list(offer.durations(size)) for size in offer.sizes}
    seconds["enum"] = list(dict.fromkeys(d for ds in durations.values() for d in ds))
    if all(ds == seconds["enum"] for ds in durations.values()):
        return {}
    default, *others = offer.sizes
    branches = [{"properties": {"size": {"const": default}, "seconds": {"enum": durations[default]}}}]
    branches += [{"required": ["size"], "properties": {"size": {"const": s}, "seconds": {"enum": durations[s]}}}
                 for s in others]
    return {"anyOf": branches}


# -- reading and checking a request ------------------------------------------------
@dataclass
class Body:
    """A create request as sent: its fields (files apart, as bytes, a list per field: reference_image repeats) and
    whether it came as a form (whose numbers are text)."""

    fields: dict[str, Any]
    files: dict[str, list[bytes]]
    form: bool


# A job's media, by the role each file plays in the run (Job.images keeps them in this order; params["media"] names
# them): jobs queued before videos carry no names, their files being [first image, last image].
MEDIA_ROLES = {"input_reference": "image", "last_image": "last_image", "mask": "mask",
               "reference_image": "reference_image", "pose_video": "pose_video", "face_video": "face_video",
               "background_video": "background_video", "mask_video": "mask_video"}
VIDEO_ROLES = ("video", "mask", "pose_video", "face_video", "background_video", "mask_video")


def parse_request(body: Body, offer: Offer, pipe: Any, magcache: dict[str, Any] | None,
                  source_frames: int | None = None) -> dict[str, Any]:
    """The job's params from a create request, checked as the CLI checks its flags; an ApiError(400) naming the
    field otherwise. `source_frames`: a diffusion forcing extension's source video's frames (derive.py), which its
    segment plan starts from."""
    for name in [*body.fields, *body.files]:
        f = BY_NAME.get(name)
        if f is None:
            raise ApiError(400, f"unknown field {name!r}", name)
        if not f.offered(offer):
            raise ApiError(400, f.refusal(offer) if f.refusal else f"{name} is not taken by this bundle", name)
        if f.type == "file" and len(body.files.get(name, [])) > (f.repeat(offer) if f.repeat else 1):
            most = f.repeat(offer) if f.repeat else 1
            raise ApiError(400, f"{name} is sent {len(body.files[name])} times; this bundle takes at most {most}",
                           name)
    values = {name: BY_NAME[name].check(value, offer, body.form) for name, value in body.fields.items()}
    if "sigmas" in values and "num_inference_steps" in values:
        raise ApiError(400, "give sigmas or num_inference_steps, not both: sigmas set the step count", "sigmas")
    for f in FIELDS:
        if f.required and f.name not in values:
            raise ApiError(400, f.mismatch or f"{f.name} is required", f.name)
    params: dict[str, Any] = {f.param: values.get(f.name) for f in FIELDS if f.param}
    steps = values.get("num_inference_steps")
    if steps is None and "sigmas" not in values and offer.defaults.steps > offer.max_steps:
        steps = offer.max_steps  # the bundle's default steps, within the server's limit
    params.update(negative_prompt=values.get("negative_prompt", ""), seed=values.get("seed", 0), steps=steps,
                  size=values.get("size", offer.sizes[0]), fps=values.get("fps", offer.defaults.fps))
    media = _check_media(body.files, offer)
    if offer.kind.any_length:
        params["frames"] = _forcing_frames(values.get("seconds"), offer)
    else:
        params["frames"] = _frames(params["size"], values.get("seconds"), offer, media.get("video_frames"))
    params["seconds"] = seconds_of(params["frames"], params["fps"])  # the mp4's duration, at the request's fps
    segments = None
    if offer.kind.animate:  # as long as the pose video, in segments of the shape's frames
        params["mode"] = params.get("mode") or "animate"
        params["prev_segment_frames"] = params.get("prev_segment_frames") or 1
        try:
            animate.check_counts(params["mode"], *(media.get(f"{n}_frames") for n in
                                                   ("pose_video", "face_video", "background_video", "mask_video")))
            segments = animate.segments(media["pose_video_frames"], params["frames"], params["prev_segment_frames"])
        except animate.InputError as e:
            raise ApiError(400, str(e), e.field) from None
        except UserError as e:
            raise ApiError(400, str(e), "pose_video" if "pose video" in str(e) else "prev_segment_frames") from None
        params["seconds"] = seconds_of(segments.frames, params["fps"])
    params["magcache"] = magcache
    params["media"] = [MEDIA_ROLES[name] if not (name == "input_reference" and offer.video_reference) else "video"
                       for name in FILE_FIELDS for _ in body.files.get(name, [])]
    if "mask" in body.files and "input_reference" in body.files and media["mask_frames"] != media["video_frames"]:
        raise ApiError(400, f"mask has {media['mask_frames']} frames, the video {media['video_frames']}: give one "
                            "mask frame per video frame", "mask")
    if "mask" in body.files and "input_reference" not in body.files and media["mask_frames"] != params["frames"]:
        raise ApiError(400, f"mask has {media['mask_frames']} frames; this video has {params['frames']}", "mask")
    if "mask" in body.files and "input_reference" in body.files and media["mask_size"] != media["video_size"]:
        raise ApiError(400, "mask is {}x{}, the video {}x{}: give a mask of the video's size".format(
            *media["mask_size"], *media["video_size"]), "mask")
    refs = len(body.files.get("reference_image", []))
    if offer.kind.reference_images and refs not in offer.reference_counts:
        counts = " or ".join(map(str, offer.reference_counts))
        raise ApiError(400, f"{refs} reference images: this bundle serves {counts}", "reference_image")
    if offer.video_to_video and "strength" in values and "input_reference" not in body.files:
        raise ApiError(400, "strength goes with a source video (input_reference)", "strength")
    try:  # the fields are each in range; the schedule their step count and flow shift make is checked here
        s = pipe.settings(params["seed"], params["steps"], params["guidance"], params["flow_shift"],
                          params["guidance_2"], params["sampler"], params["sigmas"])
    except UserError as e:  # the schedule, or sigmas that do not fit: name the field
        message = str(e)
        field = "sigmas" if "sigmas" in message else "flow_shift" if "flow_shift" in values else "num_inference_steps"
        raise ApiError(400, message.replace("flow shift", "flow_shift").replace("steps:", "num_inference_steps:"),
                       field) from None
    if s.steps > offer.max_steps:
        raise ApiError(400, f"{s.steps} steps are more than this server runs ({offer.max_steps})",
                       "sigmas" if "sigmas" in values else "num_inference_steps")
    if segments is not None and segments.count * s.steps > offer.max_steps:  # a job's steps, every segment's
        raise ApiError(400, f"{segments.count} segments of {s.steps} steps are {segments.count * s.steps} steps, more "
                            f"than this server runs ({offer.max_steps}): a shorter pose video or fewer steps",
                       "pose_video")
    if offer.kind.forcing:  # the segment plan this length makes on the bundle's shapes, and its steps
        if "last_image" in body.files and "input_reference" not in body.files:
            raise ApiError(400, "last_image needs the first frame too (input_reference)", "last_image")
        try:
            lay = forcing.layout(pipe, params["size"], None, params["frames"], params.get("overlap_history"),
                                 params.get("ar_step") or 0, params.get("causal_block_size"),
                                 params.get("addnoise_condition") or 0, len(body.files.get("input_reference", []))
                                 + len(body.files.get("last_image", [])), source_frames)
        except forcing.InputError as e:
            field = "seconds" if e.field == "num_frames" else e.field
            raise ApiError(400, str(e).replace("num_frames", "seconds"), field) from None
        rows = sum(lay.rows(s.steps))
        if rows > offer.max_steps:
            raise ApiError(400, f"{len(lay.plan.segments)} segments of {s.steps} steps are {rows} DiT steps, more than "
                                f"this server runs ({offer.max_steps}): fewer seconds or fewer steps", "seconds")
    if offer.kind.helios:  # the chunks this length makes, and their steps
        try:
            run = helios.plan_run(pipe, params["size"], None, params["frames"], params["seed"], params["steps"],
                                  params["guidance"], params["sampler"], params["sigmas"], params["flow_shift"],
                                  **{f.name: params.get(f.name) for f in HELIOS_FIELDS})
        except forcing.InputError as e:
            field = "seconds" if e.field == "num_frames" else e.field
            raise ApiError(400, str(e).replace("num_frames", "seconds"), field) from None
        if run.total > offer.max_steps:
            raise ApiError(400, f"{run.count} chunks of {run.total // run.count} steps are {run.total} DiT steps, more "
                                f"than this server runs ({offer.max_steps}): fewer seconds or fewer steps", "seconds")
        params["seconds"] = seconds_of(run.num_frames, params["fps"])
    return params


def _frames(size: str, seconds: str | None, offer: Offer, video_frames: int | None = None) -> int:
    """The frame count `seconds` asks for at `size`; left out, the video's (a source or control video) or the
    default shape's (or the size's first)."""
    durations = offer.durations(size)
    if video_frames is not None:
        if video_frames not in durations.values():
            made = " or ".join(f"{n} frames ({s} s)" for s, n in durations.items())
            raise ApiError(400, f"input_reference has {video_frames} frames; this bundle makes {made} at {size}",
                           "input_reference")
        if seconds is not None and durations.get(seconds) != video_frames:
            raise ApiError(400, f"seconds {seconds!r} is not the video's duration ({video_frames} frames): leave "
                                "seconds out", "seconds")
        return video_frames
    if seconds is None:
        default = offer.shapes[0][1]
        return default if default in durations.values() else next(iter(durations.values()))
    if seconds not in durations:
        made = " or ".join(f"{n} frames ({s} s)" for s, n in durations.items())
        raise ApiError(400, f"seconds {seconds!r} is not a duration this bundle makes at {size}: it makes {made} at "
                            f"{offer.defaults.fps} fps (leave seconds out for the default)", "seconds")
    return durations[seconds]


def _forcing_frames(seconds: str | None, offer: Offer) -> int:
    """A diffusion forcing bundle's frame count for `seconds` at the bundle's frame rate: the 4k + 1 at or above
    seconds x fps (left out: the default shape's); ApiError(400) past the server's max_seconds."""
    if seconds is None:
        return offer.shapes[0][1]
    try:
        value = float(seconds)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf or not re.fullmatch(SECONDS, seconds):
        raise ApiError(400, f"seconds {seconds!r} is not a duration: give a number of seconds such as \"10\"",
                       "seconds")
    if value > offer.max_seconds:
        raise ApiError(400, f"seconds {seconds} is longer than this server makes ({offer.max_seconds:g} s, its "
                            "--max-seconds)", "seconds")
    return forcing.frames_for(value, offer.defaults.fps)


def _check_media(files: dict[str, list[bytes]], offer: Offer) -> dict[str, Any]:
    """Check every uploaded file (images decode, videos decode and count their frames); returns what the other
    checks need: the video's and the mask's frame counts and sizes."""
    out: dict[str, Any] = {}
    if offer.kind.video == "required" and "input_reference" not in files:  # Lucy Edit: the video to edit
        try:
            kinds.check_videos(offer.kind, offer.video_to_video, None, None, None)
        except UserError as e:
            raise ApiError(400, str(e).replace("--video FILE / video=...", "input_reference"),
                           "input_reference") from None
    if not offer.video_reference:
        first, last = (files.get(n, [None])[0] for n in ("input_reference", "last_image"))
        try:
            kinds.check_images(offer.kind, first, last)
        except UserError as e:
            message = str(e)
            for cli, api in (("--image FILE / image=...", "input_reference"), ("(--image)", "(input_reference)"),
                             ("--last-image FILE / last_image=...", "last_image")):
                message = message.replace(cli, api)
            raise ApiError(400, message, "last_image" if "last image" in message else "input_reference") from None
    for name, items in files.items():
        video = BY_NAME[name].accepts(offer) == "video"
        for data in items:
            if not video:
                check_image(name, data)
                continue
            frames = check_video(name, data)
            key = "video" if name == "input_reference" else name
            out[f"{key}_frames"], out[f"{key}_size"] = len(frames), frames[0].size
    return out


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

    suffix = ".gif" if data[:4] == b"GIF8" else ".webm" if data[:4] == b"\x1a\x45\xdf\xa3" else ".mp4"
    with tempfile.TemporaryDirectory(prefix="wan-aot-upload-") as tmp:
        path = Path(tmp) / f"{what}{suffix}"
        path.write_bytes(data)
        frames = load_frames(path, what)
        return [f.copy() for f in frames]


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
