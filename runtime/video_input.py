"""Videos in: reading them (files, folders of numbered images, arrays, PIL frames) and the preprocessing diffusers'
Wan pipelines give a control video, its mask and VACE's reference images, in numpy and Pillow (no torch).

    video_pixels       VideoProcessor.preprocess_video(video, height, width) of PIL frames: float32 (F, 3, H, W)
                       in [-1, 1], each frame resized with Pillow's Lanczos (what `load_video` frames get)
    mask_pixels        the same for a mask, then (x + 1) / 2 clamped: float32 (F, C, H, W) in [0, 1] (C 1 or 3)
    reference_pixels   WanVACEPipeline's reference image: fitted into H x W with torch's bilinear resize (no
                       antialias) keeping its aspect, centred on white: float32 (3, H, W) in [-1, 1]

A video is a path (mp4, webm, mov, mkv, gif: read with imageio's ffmpeg and Pillow plugins), a folder of numbered
images (frame order by the number in each name), a list of PIL images, or an array (F, H, W, 3): uint8, or float in
[0, 1] (made uint8 as diffusers' `numpy_to_pil` does: x * 255 rounded). Every problem is a UserError naming the
input (`what`).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .errors import UserError
from .images import load_image, vae_pixels

VideoInput = Any  # a path, a folder of images, a list of PIL images or an (F, H, W, 3) array
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
MAX_FRAMES = 10_000  # a bound on what is decoded into memory


def load_frames(video: VideoInput, what: str = "video") -> list[Image.Image]:
    """The frames of `video` as RGB PIL images (at least one); UserError naming `what` otherwise."""
    if isinstance(video, (str, os.PathLike)):
        frames = _read_path(Path(video), what)
    elif isinstance(video, np.ndarray):
        frames = _from_array(video, what)
    elif isinstance(video, Sequence) and not isinstance(video, (str, bytes)):
        frames = [load_image(f, f"{what} frame {i}") for i, f in enumerate(video)]
    else:
        raise UserError(f"{what}: expected a video file or folder path, a list of PIL images or an (F, H, W, 3) "
                        f"array, got {type(video).__name__}")
    if not frames:
        raise UserError(f"{what} has no frames: give a video with at least one frame")
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise UserError(f"{what}: its frames differ in size ({', '.join(f'{w}x{h}' for w, h in sorted(sizes))}); "
                        "give frames of one size")
    return frames


def _from_array(a: np.ndarray, what: str) -> list[Image.Image]:
    if a.ndim == 3:  # (F, H, W): one channel
        a = a[..., None]
    if a.ndim != 4 or a.shape[-1] not in (1, 3) or 0 in a.shape:
        raise UserError(f"{what}: expected an array of shape (frames, height, width, 3) (or 1 channel), got "
                        f"{a.dtype} of shape {a.shape}")
    if a.dtype != np.uint8:
        if a.dtype.kind != "f" or not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
            raise UserError(f"{what}: a {a.dtype} array must hold floats in [0, 1] (or give uint8 values 0-255)")
        a = (a * 255).round().astype(np.uint8)
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    return [Image.fromarray(np.ascontiguousarray(f)) for f in a]


def _read_path(path: Path, what: str) -> list[Image.Image]:
    if not path.exists():
        raise UserError(f"{what}: {path} does not exist; give a video file or a folder of numbered images")
    if path.is_dir():
        files = [p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES]
        if not files:
            raise UserError(f"{what}: folder {path} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
        return [load_image(p, f"{what} frame {p.name}") for p in sorted(files, key=_frame_order)]
    if path.suffix.lower() in IMAGE_SUFFIXES:
        return [load_image(path, what)]
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        raise UserError(f"{what}: {path.name} is not a video this reads ({', '.join(VIDEO_SUFFIXES)}) or an image")
    import imageio.v2 as imageio

    frames = []
    try:
        with warnings.catch_warnings():
            # imageio-ffmpeg forks ffmpeg and execs at once; JAX's fork-with-threads warning doesn't apply.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            reader = imageio.get_reader(str(path))
        with reader:
            for frame in reader:
                frames.append(_rgb(np.asarray(frame)))
                if len(frames) > MAX_FRAMES:
                    raise UserError(f"{what}: {path.name} has more than {MAX_FRAMES} frames")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (ffmpeg and Pillow raise many kinds on a bad file)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{what}: cannot read {path.name} as a video ({reason[:120]}); give an mp4, webm or gif "
                        "file, or a folder of numbered images") from None
    return frames


def _rgb(frame: np.ndarray) -> Image.Image:
    if frame.ndim == 2:
        frame = np.repeat(frame[..., None], 3, axis=-1)
    return Image.fromarray(np.ascontiguousarray(frame[..., :3].astype(np.uint8)))


def _frame_order(p: Path) -> tuple:
    """Natural order: frame2 before frame10."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.stem)) + (p.suffix,)


def video_pixels(frames: list[Image.Image], width: int, height: int) -> np.ndarray:
    """float32 (F, 3, H, W) in [-1, 1]: each frame as diffusers' VideoProcessor preprocesses PIL frames."""
    return np.stack([vae_pixels(f, width, height) for f in frames])


def mask_pixels(frames: list[Image.Image], width: int, height: int) -> np.ndarray:
    """float32 (F, C, H, W) in [0, 1]: a mask as WanVACEPipeline preprocesses it (VideoProcessor, then
    clamp((x + 1) / 2)); greyscale frames keep one channel, as diffusers' `pil_to_numpy` keeps it."""
    out = []
    for f in frames:
        if f.mode in ("L", "1", "I", "F"):
            x = np.asarray(f.convert("L").resize((width, height), resample=Image.Resampling.LANCZOS))
            x = (2.0 * (x.astype(np.float32) / 255.0) - 1.0)[None]
        else:
            x = vae_pixels(f.convert("RGB"), width, height)
        out.append(np.clip((x + 1.0) / 2.0, 0.0, 1.0))
    return np.stack(out).astype(np.float32)


def load_mask(mask: VideoInput, what: str = "mask") -> list[Image.Image]:
    """A mask video's frames; greyscale kept greyscale (an array of one channel, or greyscale images)."""
    if isinstance(mask, np.ndarray) and (mask.ndim == 3 or (mask.ndim == 4 and mask.shape[-1] == 1)):
        a = mask[..., 0] if mask.ndim == 4 else mask
        if a.dtype != np.uint8:
            if a.dtype.kind != "f" or not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
                raise UserError(f"{what}: a {a.dtype} array must hold floats in [0, 1] (or give uint8 values 0-255)")
            a = (a * 255).round().astype(np.uint8)
        if 0 in a.shape:
            raise UserError(f"{what} has no frames: give a mask with at least one frame")
        return [Image.fromarray(np.ascontiguousarray(f), mode="L") for f in a]
    if isinstance(mask, Sequence) and not isinstance(mask, (str, bytes)) and mask and \
            all(isinstance(f, Image.Image) and f.mode == "L" for f in mask):
        return list(mask)
    return load_frames(mask, what)


def reference_pixels(image: Image.Image, width: int, height: int) -> np.ndarray:
    """float32 (3, H, W) in [-1, 1]: WanVACEPipeline.preprocess_conditions' reference image. The image is
    preprocessed at its own size (floored to a multiple of 8), resized with torch's bilinear interpolation
    (align_corners False, no antialias) to fit H x W keeping its aspect, and centred on a white (1.0) canvas."""
    x = vae_pixels(image, image.width, image.height, vae_scale_factor=8)
    h, w = x.shape[1:]
    scale = min(height / h, width / w)
    new_h, new_w = int(h * scale), int(w * scale)
    resized = _bilinear(x, new_h, new_w)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas = np.ones((3, height, width), np.float32)
    canvas[:, top:top + new_h, left:left + new_w] = resized
    return canvas


def _bilinear(x: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """torch.nn.functional.interpolate(mode="bilinear", align_corners=False, antialias=False) of (C, H, W), float32."""
    def taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        scale = np.float32(n_in / n_out)
        src = np.maximum((np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5), 0)
        lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, (src - lo).astype(np.float32)

    y0, y1, wy = taps(x.shape[1], out_h)
    x0, x1, wx = taps(x.shape[2], out_w)
    rows = x[:, y0] * (1 - wy)[None, :, None] + x[:, y1] * wy[None, :, None]
    return (rows[:, :, x0] * (1 - wx) + rows[:, :, x1] * wx).astype(np.float32)
