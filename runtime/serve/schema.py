"""The create request, `POST /v1/videos`: its document (`body_schema`) and its checks (`parse_request`), from one
table of its fields, read from a JSON or multipart body into the params of a job, checked as the CLI checks its flags.

The table is the one place a field is defined (request_fields.py, of fields.py's Field rows; the loops' own settings
made from runtime/loop_settings.py): its type, limits, enum and description make both the checks a request goes
through and the request body /openapi.json documents, so the two cannot drift apart (the suite runs schemathesis
against the live document to hold them to it). What depends on the bundle (its names, sizes and durations, the images
its kind takes, a second expert's guidance) comes from an Offer (fields.py), read from the manifest before the weights
load. The body itself is read by body.py. Their names are importable from here too.

The rules one field cannot state alone are kept beside the schema that states them: `seconds` is one of the
durations of the request's `size` (`_frames`, `_seconds_schema`), and the images a kind needs
(`kinds.check_images`; `required` in the document); a Wan-Animate 2 request's driving video, frame size and segments
are checked in animate2_request.py.
"""

from __future__ import annotations

import math
import re
from typing import Any

from .. import animate, forcing, helios, kinds
from ..errors import UserError
from . import animate2_request
from .body import (
    Body,
    check_image,
    check_video,
    decode_data_url,
    decode_file,
    read_body,
    read_limited,
    read_video_bytes,
)
from .errors import ApiError
from .fields import (
    DEFAULT_MAX_SECONDS,
    FLOW_SHIFT,
    MAX_BODY_BYTES,
    MAX_FILES,
    MAX_FPS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_PROMPT_CHARS,
    MAX_STEPS,
    MAX_VIDEO_BODY_BYTES,
    MAX_VIDEO_BYTES,
    MAX_VIDEO_PIXELS,
    NOT_BLANK,
    POLL_AFTER_MS,
    SIGMA_MIN,
    Bound,
    Field,
    Offer,
    file_schema,
    seconds_of,
    sigmas_text,
)
from .jsonnum import number as _number
from .request_fields import BY_NAME, FIELDS, FILE_FIELDS, HELIOS_FIELDS

__all__ = ["BY_NAME", "DEFAULT_MAX_SECONDS", "FIELDS", "FILE_FIELDS", "FLOW_SHIFT", "HELIOS_FIELDS", "MAX_BODY_BYTES",
           "MAX_FILES", "MAX_FPS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "MAX_PROMPT_CHARS", "MAX_STEPS",
           "MAX_VIDEO_BODY_BYTES", "MAX_VIDEO_BYTES", "MAX_VIDEO_PIXELS", "MEDIA_ROLES", "NOT_BLANK",
           "NOT_BOTH_STEP_COUNTS", "POLL_AFTER_MS", "SECONDS", "SIGMA_MIN", "VIDEO_ROLES", "Body", "Bound", "Field",
           "Offer", "_number", "body_schema", "check_image", "check_video", "decode_data_url", "decode_file",
           "file_schema", "parse_request", "read_body", "read_limited", "read_video_bytes", "seconds_of",
           "sigmas_text"]


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
    if offer.kind.animate2:  # the character (input_reference, required as the kind's image) and its driving video
        required += ["driving_video"]
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



# A job's media, by the role each file plays in the run (Job.images keeps them in this order; params["media"] names
# them): jobs queued before videos carry no names, their files being [first image, last image].
MEDIA_ROLES = {"input_reference": "image", "last_image": "last_image", "mask": "mask",
               "reference_image": "reference_image", "pose_video": "pose_video", "face_video": "face_video",
               "background_video": "background_video", "mask_video": "mask_video", "driving_video": "driving_video"}
VIDEO_ROLES = ("video", "mask", "pose_video", "face_video", "background_video", "mask_video", "driving_video")


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
    driving = animate2_request.plan(params, values, body.files, media, offer, pipe) if offer.kind.animate2 else None
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
    if driving is not None and driving.count * s.steps > offer.max_steps:  # every segment's steps
        raise ApiError(400, f"{driving.count} segments of {s.steps} steps are {driving.count * s.steps} steps, more "
                            f"than this server runs ({offer.max_steps}): a shorter driving video, a lower fps or fewer "
                            "steps", "driving_video")
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
