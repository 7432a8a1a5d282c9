"""Writing frames to a video file, atomically: mp4/mkv/mov (H.264, yuv420p) through imageio-ffmpeg, GIF
through Pillow. The format is checked from the file name before any work (`check_video_path`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from .errors import UserError
from .files import atomic_path


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """[0, 1] float frames -> uint8, as diffusers' export_to_video does (x * 255, truncated)."""
    return (np.clip(frames, 0.0, 1.0) * 255).astype(np.uint8)


FORMATS = {".mp4": "ffmpeg", ".mkv": "ffmpeg", ".mov": "ffmpeg", ".gif": "pillow"}


def check_video_path(path: str | os.PathLike) -> Path:
    """Refuse a file name whose format we cannot write (before any work is done)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise UserError(f"cannot write video format {path.suffix or '(no extension)'!r} ({path}): name the "
                        f"output {' or '.join('NAME' + f for f in FORMATS)}")
    return path


def check_fps(fps: int) -> int:
    if isinstance(fps, bool) or not isinstance(fps, (int, np.integer)) or fps < 1:
        raise UserError(f"fps must be an integer >= 1, got {fps!r}")
    return int(fps)


def write_video(frames: np.ndarray, path: str | os.PathLike, fps: int = 16) -> Path:
    """Write (F, H, W, 3) or (1, F, H, W, 3) frames in [0, 1] to `path` (.mp4, .mkv, .mov or .gif)."""
    import imageio.v2 as imageio

    frames = np.asarray(frames)
    if frames.ndim == 5:
        if frames.shape[0] != 1:
            raise UserError(f"write_video takes one video; got a batch of {frames.shape[0]} (write each)")
        frames = frames[0]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise UserError(f"frames must be (F, H, W, 3), got shape {frames.shape}")
    fps = check_fps(fps)
    path = check_video_path(path)
    if FORMATS[path.suffix.lower()] == "pillow":
        from PIL import Image

        pictures = [Image.fromarray(f) for f in to_uint8(frames)]
        with atomic_path(path) as tmp:
            pictures[0].save(tmp, format="GIF", save_all=True, append_images=pictures[1:],
                             duration=max(1, round(1000 / fps)), loop=0)
        return path
    with atomic_path(path) as tmp, warnings.catch_warnings():
        # imageio-ffmpeg forks ffmpeg and execs at once; JAX's fork-with-threads warning doesn't apply.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        writer = imageio.get_writer(str(tmp), format="FFMPEG", fps=fps, codec="libx264", pixelformat="yuv420p",
                                    macro_block_size=1, output_params=["-movflags", "+faststart"])
        try:
            for frame in to_uint8(frames):
                writer.append_data(frame)
        finally:
            writer.close()
        if path.suffix.lower() in (".mp4", ".mov"):
            check_complete(tmp)
    return path


def check_complete(path: Path) -> None:
    """An ISO BMFF file (mp4, mov) whose top-level boxes fill it exactly and include ftyp, moov and mdat; OSError
    otherwise (ENOSPC if its disk has no room left), so that a file ffmpeg left short, which it can do with a zero
    exit on a full disk, is never renamed into place."""
    size, at, boxes = os.path.getsize(path), 0, set()
    with open(path, "rb") as f:
        while at < size:
            f.seek(at)
            head = f.read(16)
            if len(head) < 8:
                break
            length, kind = int.from_bytes(head[:4], "big"), head[4:8]
            if length == 1 and len(head) == 16:
                length = int.from_bytes(head[8:16], "big")
            elif length == 0:
                length = size - at
            if length < 8:
                break
            boxes.add(kind)
            at += length
    if at != size or not {b"ftyp", b"moov", b"mdat"} <= boxes:
        import errno
        import shutil

        full = shutil.disk_usage(path.parent).free < (1 << 20)
        raise OSError(errno.ENOSPC if full else errno.EIO,
                      f"the video written is incomplete ({size} bytes){': no space left on device' * full}")


def write_videos(frames: np.ndarray, path: str | os.PathLike, fps: int = 16) -> list[Path]:
    """A batch (B, F, H, W, 3): one video at `path`, or NAME-<i>.ext for each video when B > 1."""
    path = Path(path)
    if frames.shape[0] == 1:
        return [write_video(frames[0], path, fps=fps)]
    return [write_video(f, path.with_name(f"{path.stem}-{i}{path.suffix}"), fps=fps) for i, f in enumerate(frames)]
