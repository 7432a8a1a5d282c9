"""Wan-Animate 2's create request (kinds "animate-2", "animate-2-distilled"; the loop is runtime/animate2.py): what no
one field can check alone, checked when the request comes, by the rules the run itself applies, so that a job that is
queued runs and one that could not is a 400 naming the field, with nothing stored:

- the driving video is there (`driving_video`), and its frame rate is the field's or the file's own (what the CLI's
  --driving-video-fps defaults to), recorded in the job's params so that the worker resamples it the same way;
- its frames after resampling to `fps` (the video's length: `seconds` is its, not a field);
- the frame size the character image's aspect makes at the area of `size` (or of each size in turn) is one of the
  bundle's (runtime/animate2.py `pick_shape`, the rule the run uses): the job's `size` is that frame size, and the
  run gets the size asked for (`area`), since resolving a resolved size again can floor it further;
- the segments those frames make at that shape's frames (prev_segment_conditioning_frames fewer than them, a video
  longer than it), whose steps the caller holds to the server's limit.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any

from .. import animate2, animate2_media, images
from ..errors import UserError
from .body import video_suffix
from .errors import ApiError
from .fields import Offer, seconds_of

DEFAULT_PREV = 1  # WanAnimate2's prev_segment_conditioning_frames default


def file_fps(data: bytes) -> float | None:
    """The frame rate an uploaded video file says it has (None for one that says none: a GIF's frames are taken as
    they are), read as the CLI reads a file's (runtime/animate2_media.py `video_fps`)."""
    with tempfile.TemporaryDirectory(prefix="wan-aot-upload-") as tmp:
        path = Path(tmp) / f"driving_video{video_suffix(data)}"
        path.write_bytes(data)
        return animate2_media.video_fps(path)


MOST_FRAMES = 1e9  # a resampled length beyond any step limit (and within a float's range): refused as it is


def resampled_frames(frames: int, driving_fps: float | None, fps: int) -> int:
    """The driving video's frames at `fps` (runtime/animate2_media.py `frame_indices`' count), without building the
    index list: a low driving_video_fps asks for many frames, refused by the step limit before any is made (and one
    so low that they overflow a float, here)."""
    if driving_fps is None:
        return frames
    planned = frames / driving_fps * fps
    if not planned < MOST_FRAMES:
        raise ApiError(400, f"driving_video_fps {driving_fps!r} makes the driving video's {frames} frames more than "
                            f"{MOST_FRAMES:.0e} at {fps} fps: give the video's own frame rate (or leave it out)",
                       "driving_video_fps")
    return int(planned)


def plan(params: dict[str, Any], values: dict[str, Any], files: dict[str, list[bytes]], media: dict[str, Any],
         offer: Offer, pipe: Any) -> animate2_media.Segments:
    """Fill the job's params of a Wan-Animate 2 request (`size`, `frames`, `seconds`, `area`, `driving_video_fps`,
    `prev_segment_conditioning_frames`) and return its segments; ApiError(400) naming the field where it cannot run.
    `media`: what schema._check_media found of the uploads (the driving video's frame count)."""
    if "driving_video" not in files:
        raise ApiError(400, f"this bundle is {offer.kind.title}: it needs a driving video (driving_video: mp4, webm "
                            "or gif), whose motion the character follows", "driving_video")
    driving_fps = values.get("driving_video_fps")
    if driving_fps is None:
        driving_fps = file_fps(files["driving_video"][0])
    count = resampled_frames(media["driving_video_frames"], driving_fps, params["fps"])
    from PIL import Image

    image = images.load_image(Image.open(io.BytesIO(files["input_reference"][0])), "input_reference")
    area = values.get("size")
    try:
        g = animate2.pick_shape(pipe, image.size, area, None)
    except UserError as e:
        raise ApiError(400, str(e), "input_reference") from None
    prev = values.get("prev_segment_conditioning_frames", DEFAULT_PREV)
    try:
        segments = animate2_media.segments(count, g.frames, prev)
    except UserError as e:
        field = "prev_segment_conditioning_frames" if str(e).startswith("prev_segment") else "driving_video"
        raise ApiError(400, str(e), field) from None
    params.update(size=g.size, frames=g.frames, area=area, driving_video_fps=driving_fps,
                  prev_segment_conditioning_frames=prev, seconds=seconds_of(count, params["fps"]))
    return segments
