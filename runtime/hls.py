"""A video as an HLS live stream (RFC 8216) while it is made: an EVENT playlist, `stream.m3u8`, and its segments,
`stream/<n>.ts`, one added for each part of the video as it is decoded (a diffusion forcing segment's new frames, a
Wan-Animate segment's, the whole video for the one-shape kinds), and `#EXT-X-ENDLIST` once it ends.

The segments are MPEG-TS (H.264, yuv420p, as the mp4), not fMP4: each .ts segment is a whole H.264 stream of its own
(an IDR frame first, its parameter sets in band), so each is encoded alone when its frames arrive, by one short
ffmpeg run, with nothing shared between segments: an fMP4 stream's one init segment would bind every later segment
to the first encoder's parameters. The timestamps run on from segment to segment (`-output_ts_offset`), so a player
plays the joined stream as one video; concatenated, the segments are one valid transport stream. No B-frames: with
them a segment's first timestamp moves by the encoder's reorder delay, which differs with the segment's length
(a one-frame segment has none), and the joined stream would skip or repeat a frame at such a boundary.

Where the files go is a `put(name, data)` the caller gives (a directory: `directory_sink`; the server: its video
storage), each written whole, the segment before the playlist that names it. The playlist's URIs are relative
(`stream/0.ts`): the same text serves a directory (DIR/stream.m3u8 beside DIR/stream/) and the server's routes
(/v1/videos/{id}/stream.m3u8 beside /v1/videos/{id}/stream/0.ts).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import UserError
from .files import atomic_path
from .video import check_fps, to_uint8

PLAYLIST = "stream.m3u8"
SEGMENT_TYPE = "video/mp2t"
PLAYLIST_TYPE = "application/vnd.apple.mpegurl"


def segment_name(n: int) -> str:
    return f"stream/{n}.ts"


def segment_index(name: str) -> int:
    """n of `segment_name(n)`; ValueError for another name."""
    m = re.fullmatch(r"stream/(0|[1-9][0-9]{0,8})\.ts", name)
    if m is None:
        raise ValueError(f"{name!r} is not a segment's name")
    return int(m.group(1))


@dataclass
class Playlist:
    """An EVENT playlist: segments only added, never changed or removed; `ended` once the video is whole."""

    durations: list[float] = field(default_factory=list)  # seconds, per segment
    ended: bool = False

    def text(self) -> str:
        # The target duration bounds every segment's (rounded): a segment loop's first part is its longest.
        target = max([1, *(math.ceil(d - 1e-6) for d in self.durations)])
        lines = ["#EXTM3U", "#EXT-X-VERSION:3", f"#EXT-X-TARGETDURATION:{target}", "#EXT-X-MEDIA-SEQUENCE:0",
                 "#EXT-X-PLAYLIST-TYPE:EVENT", "#EXT-X-INDEPENDENT-SEGMENTS"]
        for n, d in enumerate(self.durations):
            lines += [f"#EXTINF:{d:.6f},", segment_name(n)]
        if self.ended:
            lines.append("#EXT-X-ENDLIST")
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> Playlist:
        """A playlist this module wrote (ValueError otherwise)."""
        if not text.startswith("#EXTM3U"):
            raise ValueError("not an m3u8 playlist")
        durations = [float(d) for d in re.findall(r"^#EXTINF:([0-9.]+),", text, re.M)]
        return cls(durations, "#EXT-X-ENDLIST" in text)


def encode_segment(frames: np.ndarray, fps: int, start_frame: int) -> bytes:
    """(F, H, W, 3) frames in [0, 1] (or uint8) as one MPEG-TS segment whose timestamps start at frame
    `start_frame` of the video."""
    import imageio_ffmpeg

    pixels = np.ascontiguousarray(frames if frames.dtype == np.uint8 else to_uint8(frames))
    with tempfile.TemporaryDirectory(prefix="wan-aot-hls-") as d, warnings.catch_warnings():
        # imageio-ffmpeg forks ffmpeg and execs at once; JAX's fork-with-threads warning doesn't apply.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        path = os.path.join(d, "segment.ts")
        writer = imageio_ffmpeg.write_frames(path, (pixels.shape[2], pixels.shape[1]), fps=fps, codec="libx264",
                                             pix_fmt_out="yuv420p", macro_block_size=1, ffmpeg_log_level="error",
                                             output_params=["-bf", "0", "-f", "mpegts", "-output_ts_offset",
                                                            f"{start_frame / fps:.6f}"])
        writer.send(None)
        try:
            for frame in pixels:
                writer.send(frame)
        finally:
            writer.close()
        return Path(path).read_bytes()


class HlsWriter:
    """Adds a video's frames to its live stream as they come: `add(frames)` encodes them as the next segment and
    writes it, then the playlist naming it; `end()` writes the playlist ended. A batch's first video is the one
    streamed."""

    def __init__(self, put: Callable[[str, bytes], None], fps: int, open_now: bool = True) -> None:
        """`open_now`: write the empty playlist at once (a server's job, checked before it was queued: a player may
        open the stream before its first segment); else with the first segment (a local run, whose settings a loop
        may still refuse: a refused run then writes nothing)."""
        self.put = put
        self.fps = check_fps(fps)
        self.playlist = Playlist()
        self.frames = 0
        self.opened = open_now
        if open_now:
            self.put(PLAYLIST, self.playlist.text().encode())

    def add(self, frames: np.ndarray) -> None:
        frames = np.asarray(frames)
        if frames.ndim == 5:
            frames = frames[0]
        if not len(frames):
            return
        n = len(self.playlist.durations)
        self.put(segment_name(n), encode_segment(frames, self.fps, self.frames))
        self.frames += len(frames)
        self.playlist.durations.append(len(frames) / self.fps)
        self.put(PLAYLIST, self.playlist.text().encode())

    def end(self) -> bool:
        """End the stream (its playlist says so); whether there is one (a stream never opened stays unwritten)."""
        if not self.playlist.ended and (self.opened or self.playlist.durations):
            self.playlist.ended = True
            self.put(PLAYLIST, self.playlist.text().encode())
        return self.playlist.ended


def directory_sink(root: str | os.PathLike) -> Callable[[str, bytes], None]:
    """`put` for a stream in directory `root` (made, with its stream/ folder, when the first file is written): each
    file written under a temporary name, then renamed, so a player never reads one half written. UserError now for a
    `root` that cannot be a directory made there (a file, or under one; a parent not writable)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UserError(f"--stream {root} is a file: give a directory (made if missing) for the playlist and segments")
    parent = root
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--stream {root}: cannot make the directory ({parent} is not a writable directory)")

    def put(name: str, data: bytes) -> None:
        try:
            (root / "stream").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--stream {root}: cannot make the directory ({e.strerror})") from None
        with atomic_path(root / name) as tmp:
            tmp.write_bytes(data)

    return put
