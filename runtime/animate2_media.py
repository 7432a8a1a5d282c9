"""Wan-Animate 2's inputs as diffusers' modular blocks prepare them (modular_pipelines/wan_animate_2/encoders.py,
video_processor.py, 0.42.1), in numpy and Pillow: the frame size, the letterbox, the driving video's resampling and
segments, the CLIP pixels. Pure functions; runtime/animate2.py runs the loop on them.

- Frame size (WanAnimate2ProcessImagesInputStep): the requested area (a bundle size's width x height) at the
  character image's aspect ratio, the image's own size first rounded as WanAnimate2VideoProcessor's
  get_default_height_width rounds it, each side floored to a multiple of 16 (VAE x patch).
- Letterbox (WanAnimate2VideoProcessor._resize_and_fill): the image (bicubic) or each driving frame (bilinear) resized
  with Pillow to fit, pasted at ((W - w) // 2, (H - h) // 2) on black; the generated video is cropped back to the
  image's box (`crop_region`, from the rounded image size, as diffusers computes it).
- Resampling (get_frame_indices): with a driving frame rate, int(n / fps_in x fps) frames, frame i the input's
  round(i / fps x fps_in) (numpy's round half to even), clipped to the last; without one the frames are used as given.
- Segments (WanAnimate2ProcessVideosInputStep): segment k covers frames [k (S - prev), k (S - prev) + S); when the
  frames after the first prev do not fill whole segments, the video is padded with its own last frames mirrored
  ([0 1 2 3 4] + 3 -> [0 1 2 3 4 | 4 3 2]) and the output is cut back to the video's length.
- CLIP pixels (clip_visual_encode): the letterboxed image in [-1, 1] resized to 224 x 224 by torch's bicubic
  interpolation (align_corners False, no antialias), mapped to [0, 1] and normalised with CLIP's mean and std.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .errors import UserError

CLIP_SIZE = 224  # clip_visual_encode's resize
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
# WanAnimate2TextEncoderStep's prompt_ref ("a reference video of the person's motion")
DEFAULT_PROMPT_REF = "人物动作的参考视频"
IMAGE_RESAMPLE = Image.Resampling.BICUBIC  # the image processor's (WanAnimate2ProcessImagesInputStep)
VIDEO_RESAMPLE = Image.Resampling.BILINEAR  # the video processor's (WanAnimate2ProcessVideosInputStep)


def rounded_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """get_default_height_width(image) of an image of this size: (width, height) kept at their area and aspect,
    each rounded then floored to `multiple`."""
    area, aspect = width * height, height / width
    h = round(np.sqrt(area * aspect)) // multiple * multiple
    w = round(np.sqrt(area / aspect)) // multiple * multiple
    return int(w), int(h)


def frame_size(image_size: tuple[int, int], area: int, multiple: int) -> tuple[int, int]:
    """The (width, height) of the video made from an image of `image_size` (width, height) for a requested `area`."""
    iw, ih = rounded_size(*image_size, multiple)
    if iw == 0 or ih == 0:
        raise UserError(f"the image is {image_size[0]}x{image_size[1]}: too small for Wan-Animate 2 (both sides "
                        f"must round to at least {multiple} pixels)")
    aspect = ih / iw
    return int(math.sqrt(area / aspect)) // multiple * multiple, int(math.sqrt(area * aspect)) // multiple * multiple


def crop_region(size: tuple[int, int], image_size: tuple[int, int], multiple: int) -> tuple[int, int, int, int]:
    """(top, left, height, width) of the image inside the letterboxed frame `size` (width, height), from the image's
    rounded size, as diffusers crops its output."""
    width, height = size
    iw, ih = rounded_size(*image_size, multiple)
    crop_w = width if width / height < iw / ih else iw * height // ih
    crop_h = height if width / height >= iw / ih else ih * width // iw
    return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w


def letterbox(image: Image.Image, width: int, height: int, resample: Any) -> np.ndarray:
    """float32 (3, H, W) in [-1, 1]: `image` fitted into width x height keeping its aspect, centred on black."""
    ratio, src_ratio = width / height, image.width / image.height
    src_w = width if ratio < src_ratio else image.width * height // image.height
    src_h = height if ratio >= src_ratio else image.height * width // image.width
    canvas = Image.new("RGB", (width, height), color=0)
    canvas.paste(image.resize((src_w, src_h), resample=resample), box=((width - src_w) // 2, (height - src_h) // 2))
    x = np.asarray(canvas).astype(np.float32) / np.float32(255.0)
    return np.ascontiguousarray((2.0 * x - 1.0).transpose(2, 0, 1))


def frame_indices(frames: int, video_fps: float, fps: float) -> list[int]:
    """get_frame_indices: the input frames of a `video_fps` clip resampled to `fps` (nearest frame)."""
    count = int(frames / video_fps * fps)
    times = np.arange(0, count) / fps
    return np.clip(np.round(times * video_fps).astype(int), 0, frames - 1).tolist()


@dataclass(frozen=True)
class Segments:
    """A driving video of `frames` frames in segments of `length` overlapping by `prev`."""

    frames: int
    length: int
    prev: int

    @property
    def stride(self) -> int:
        return self.length - self.prev

    @property
    def padding(self) -> int:
        leftover = (self.frames - self.prev) % self.stride
        return self.stride - leftover if leftover else 0

    @property
    def count(self) -> int:
        return (self.frames + self.padding - self.prev) // self.stride

    def window(self, k: int) -> slice:
        return slice(k * self.stride, k * self.stride + self.length)

    def padded(self) -> list[int]:
        """The frame index at each position of the padded video: the video, then its last frames mirrored
        (diffusers' flip of frames [n - padding, n)). Where the padding is longer than the video, which diffusers
        cannot pad (its slice comes out short and the segment fails), the mirror goes on back and forth."""
        n = self.frames
        cycle = list(range(n - 1, -1, -1)) + list(range(n))  # n-1 .. 0, then 0 .. n-1, ...
        return list(range(n)) + [cycle[i % len(cycle)] for i in range(self.padding)]


def segments(frames: int, length: int, prev: Any) -> Segments:
    """The segments of a driving video of `frames` frames (after resampling) on a bundle shape of `length` frames;
    UserError for a prev_segment_conditioning_frames out of range or a video no longer than it."""
    if isinstance(prev, bool) or not isinstance(prev, (int, np.integer)) or not 0 <= prev < length:
        raise UserError(f"prev_segment_conditioning_frames must be a whole number from 0 to {length - 1} (the "
                        f"segment's frames less one), got {prev!r}")
    if frames <= prev:
        raise UserError(f"the driving video has {frames} frame{'s' * (frames != 1)} (after resampling to the fps): it "
                        f"needs more than prev_segment_conditioning_frames ({prev})")
    return Segments(frames, length, int(prev))


def _cubic_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's upsample_bicubic2d (align_corners False, A = -0.75) along one axis: (n_out, 4) input indices
    (clamped to the edge) and weights."""
    a = -0.75
    scale = np.float32(n_in / n_out)
    real = scale * (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5)
    base = np.floor(real)
    t = (real - base).astype(np.float32)

    def near(x: np.ndarray) -> np.ndarray:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: np.ndarray) -> np.ndarray:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=1).astype(np.float32)
    index = np.clip(base.astype(np.int64)[:, None] + np.arange(-1, 3)[None], 0, n_in - 1)
    return index, weights


def bicubic(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch.nn.functional.interpolate(x, (height, width), mode="bicubic", align_corners=False) of x (C, H, W)."""
    rows, row_w = _cubic_taps(x.shape[1], height)
    cols, col_w = _cubic_taps(x.shape[2], width)
    x = np.einsum("chkw,hk->chw", x[:, rows], row_w)
    return np.einsum("chwk,wk->chw", x[:, :, cols], col_w).astype(np.float32)


def clip_pixels(pixels: np.ndarray) -> np.ndarray:
    """float32 (1, 3, 224, 224): clip_visual_encode's input from a letterboxed frame (3, H, W) in [-1, 1]."""
    x = bicubic(pixels.astype(np.float32), CLIP_SIZE, CLIP_SIZE) * np.float32(0.5) + np.float32(0.5)
    return np.ascontiguousarray(((x - CLIP_MEAN[:, None, None]) / CLIP_STD[:, None, None])[None], np.float32)


def video_fps(video: Any) -> float | None:
    """The frame rate a video file says it has (None for frames, folders and files that say none): what the CLI's
    --driving-video-fps defaults to."""
    if not isinstance(video, (str, Path)) or Path(video).is_dir():
        return None
    try:
        import imageio.v2 as imageio

        with warnings.catch_warnings():  # (imageio-ffmpeg forks ffmpeg and execs at once, as runtime/video_input.py)
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            reader = imageio.get_reader(str(video))
        with reader:
            fps = reader.get_meta_data().get("fps")
    except Exception:  # noqa: BLE001  (unreadable files fail where the frames are read, in one line)
        return None
    return float(fps) if fps and np.isfinite(fps) and fps > 0 else None
