"""The images `GET /v1/videos/{id}/content?variant=thumbnail|spritesheet` answers with, and the live preview of a
running job.

- While a job runs, the worker hands every step's preview (runtime/previews.py: the denoised estimate of the video's
  middle frame at the latents' resolution, through a fixed linear map) to a `PreviewWriter`, which keeps only the
  latest and stores it (PNG, lossless, a few kilobytes) under the job's preview key, off the denoising loop's thread.
  `variant=thumbnail` reads it from any replica and answers it as a WebP at the video's size.
- When a job completes, the worker makes, from the frames in memory, the video's first frame as a WebP (the
  thumbnail) and a spritesheet (`spritesheet`), stored beside the mp4 (jobs.derived_keys).

The spritesheet's geometry, for clients that cut it up:

- n = min(SPRITE_FRAMES, F) frames of the F the video has, evenly spaced: frame round(k x (F - 1) / (n - 1)) for
  k = 0..n-1 (the first and the last always among them; frame 0 alone when n = 1);
- each tile is its frame scaled (bicubic) to width tw = min(W, SPRITE_TILE_WIDTH) and height
  th = max(1, round(H x tw / W)), keeping the aspect (never enlarged);
- the tiles go left to right, top to bottom, in rows of c = ceil(sqrt(n)) columns, r = ceil(n / c) rows, with no
  gaps: tile k's top-left corner is ((k mod c) x tw, (k div c) x th); the sheet is c x tw by r x th pixels, and the
  cells after the last tile are black;
- a JPEG (quality SPRITE_QUALITY, baseline); `spritesheet_geometry(F, W, H)` gives (n, c, r, tw, th).
"""

from __future__ import annotations

import io
import logging
import math
import threading
from typing import Any

import numpy as np

log = logging.getLogger("runtime")

SPRITE_FRAMES = 16  # the most frames a spritesheet shows
SPRITE_TILE_WIDTH = 256  # the widest tile, in pixels
SPRITE_QUALITY = 90
THUMBNAIL_QUALITY = 90  # WebP, lossy
PREVIEW_QUALITY = 80


def spritesheet_geometry(frames: int, width: int, height: int) -> tuple[int, int, int, int, int]:
    """(n frames shown, columns, rows, tile width, tile height) of a video of `frames` frames of width x height."""
    n = max(1, min(SPRITE_FRAMES, frames))
    columns = math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    tw = min(width, SPRITE_TILE_WIDTH)
    th = max(1, round(height * tw / width))
    return n, columns, rows, tw, th


def sprite_indices(frames: int) -> list[int]:
    """The frames a spritesheet shows, in order."""
    n = spritesheet_geometry(frames, 1, 1)[0]
    return [0] if n == 1 else [round(k * (frames - 1) / (n - 1)) for k in range(n)]


def _uint8(frames: Any) -> np.ndarray:
    from ..video import to_uint8

    frames = np.asarray(frames)
    return frames if frames.dtype == np.uint8 else to_uint8(frames)


def webp(image: Any, quality: int = THUMBNAIL_QUALITY) -> bytes:
    out = io.BytesIO()
    image.save(out, format="WEBP", quality=quality, method=4)
    return out.getvalue()


def thumbnail(frames: Any) -> bytes:
    """The video's first frame as a WebP at its size; `frames` (F, H, W, 3), uint8 or floats in [0, 1] (converted as
    the mp4's are)."""
    from PIL import Image

    return webp(Image.fromarray(_uint8(frames)[0]))


def spritesheet(frames: Any) -> bytes:
    """The JPEG grid of evenly spaced frames (the module docstring says its geometry)."""
    from PIL import Image

    frames = _uint8(frames)
    f, h, w = frames.shape[:3]
    n, columns, rows, tw, th = spritesheet_geometry(f, w, h)
    sheet = Image.new("RGB", (columns * tw, rows * th))
    for k, index in enumerate(sprite_indices(f)):
        tile = Image.fromarray(frames[index])
        if tile.size != (tw, th):
            tile = tile.resize((tw, th), Image.BICUBIC)
        sheet.paste(tile, ((k % columns) * tw, (k // columns) * th))
    out = io.BytesIO()
    sheet.save(out, format="JPEG", quality=SPRITE_QUALITY)
    return out.getvalue()


def derive(frames: Any) -> tuple[bytes, bytes]:
    """(thumbnail, spritesheet) of a finished video's frames, in jobs.derived_keys' order."""
    frames = _uint8(frames)
    return thumbnail(frames), spritesheet(frames)


def from_video(data: bytes) -> tuple[bytes, bytes]:
    """(thumbnail, spritesheet) of an mp4 (a video completed before these were stored with it)."""
    from .schema import read_video_bytes

    frames = np.stack([np.asarray(f.convert("RGB")) for f in read_video_bytes(data, "video")])
    return derive(frames)


def live(png: bytes, size: str) -> bytes:
    """A stored preview (PNG, the latents' resolution) as the WebP `variant=thumbnail` answers while a job runs: at
    the video's size ("WxH")."""
    from PIL import Image

    from ..previews import upscale

    width, height = (int(v) for v in size.lower().split("x"))
    with Image.open(io.BytesIO(png)) as image:
        rgb = np.asarray(image.convert("RGB"))
    return webp(upscale(rgb, width, height), PREVIEW_QUALITY)


def png(rgb: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.asarray(rgb, np.uint8)).save(out, format="PNG", compress_level=1)
    return out.getvalue()


class PreviewWriter:
    """Stores the latest preview a running job offers (`offer`, from the denoising loop: it only hands the array
    over, but for the first, stored at once) under `key`, in a thread of its own; a preview offered while one is being
    stored replaces the one waiting, so a slow store (an object store's PUT) never holds a step up nor builds a
    backlog. `close` stores the last one and stops."""

    def __init__(self, storage: Any, key: str) -> None:
        self.storage, self.key = storage, key
        self._latest: np.ndarray | None = None
        self._closed = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self.written = 0
        self._failed = False

    def offer(self, rgb: np.ndarray) -> None:
        if self._thread is None:  # the first is stored now, before the step's progress is: a client that sees
            self._store(rgb)  # progress finds a preview; then a thread keeps up, off the denoising loop
            self._thread = threading.Thread(target=self._run, name="wan-aot-preview", daemon=True)
            self._thread.start()
            return
        with self._wake:
            self._latest = rgb
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._latest is None and not self._closed:
                    self._wake.wait()
                rgb, self._latest = self._latest, None
                if rgb is None:
                    return
            self._store(rgb)

    def _store(self, rgb: np.ndarray) -> None:
        try:
            self.storage.put(self.key, png(rgb), retry=False)  # a failing store: this one is skipped
            self.written += 1
        except Exception as e:  # noqa: BLE001  (a preview is a nicety: the job goes on, one line in the log)
            if not self._failed:
                log.warning("cannot store the live preview %s: %s: %s", self.key, type(e).__name__, e)
                self._failed = True

    def close(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
