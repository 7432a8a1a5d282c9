"""A video as fragmented MP4 (ISO BMFF, H.264 yuv420p) made part by part as its frames arrive, for a browser's
MediaSource: one init segment (ftyp + moov) once, then each part's media segment (moof + mdat), appended in order.

Why each part is encoded by a short ffmpeg run of its own, not one ffmpeg fed for the whole video: ffmpeg's mp4 muxer
writes a fragment only when the packet after it arrives (`frag_keyframe`, even `frag_every_frame`), so a long-lived
encoder would hold each part's last frames until the next part exists, a whole chunk late. A run per part ends with
its fragment written. Each run starts with an IDR frame (a media segment MediaSource can begin at) and, with the same
size, frame rate and settings, writes a byte-identical init segment (its avcC: H.264's parameter sets do not depend on
the frames), so the first run's init serves them all; that is checked on every part. What a run cannot know is where
its part sits in the video: its fragment's decode time (tfdt) starts at 0 and its sequence number (mfhd) at 1, so both
are moved on here, by the frames and fragments before it. No B-frames (`-bf 0`): decode order is display order.

Concatenated, the init segment and the parts' fragments are one valid fragmented mp4 that ffmpeg decodes whole."""

from __future__ import annotations

import struct
import subprocess
import warnings

import numpy as np

from .video import check_fps, to_uint8


def boxes(data: bytes | bytearray, start: int = 0, end: int | None = None) -> list[tuple[str, int, int]]:
    """The ISO BMFF boxes laid end to end in data[start:end]: (type, offset, size) each. ValueError for bytes that
    are not boxes (a size past the end, a size below a box header)."""
    end = len(data) if end is None else end
    out, i = [], start
    while i < end:
        if end - i < 8:
            raise ValueError(f"{end - i} stray bytes at offset {i}: not an ISO BMFF box")
        size = int.from_bytes(data[i:i + 4], "big")
        kind = bytes(data[i + 4:i + 8]).decode("latin-1")
        if size == 1:  # a 64-bit size follows the type
            size = int.from_bytes(data[i + 8:i + 16], "big")
        if size < 8 or i + size > end:
            raise ValueError(f"box {kind!r} at offset {i} claims {size} bytes; {end - i} remain")
        out.append((kind, i, size))
        i += size
    return out


def _child(data: bytes | bytearray, parent: tuple[str, int, int], kind: str) -> tuple[str, int, int]:
    """The first box of type `kind` inside box `parent` (ValueError if it has none)."""
    _, offset, size = parent
    for box in boxes(data, offset + 8, offset + size):
        if box[0] == kind:
            return box
    raise ValueError(f"box {parent[0]!r} has no {kind!r}")


def encode_fragmented(frames: np.ndarray, fps: int) -> bytes:
    """(F, H, W, 3) frames in [0, 1] (or uint8) as one fragmented mp4: ftyp, moov (no samples), then moof + mdat."""
    import imageio_ffmpeg

    pixels = np.ascontiguousarray(frames if frames.dtype == np.uint8 else to_uint8(frames))
    _, height, width, _ = pixels.shape
    args = [imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s",
            f"{width}x{height}", "-r", str(fps), "-i", "-", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-bf", "0",
            "-f", "mp4", "-movflags", "+frag_keyframe+empty_moov+default_base_moof", "-"]
    with warnings.catch_warnings():
        # ffmpeg is forked and execs at once; JAX's fork-with-threads warning doesn't apply.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        proc = subprocess.run(args, input=pixels.tobytes(), capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ffmpeg could not encode {len(pixels)} frames of {width}x{height}: "
                           f"{proc.stderr.decode(errors='replace').strip()[-500:]}")
    return proc.stdout


class Fragments:
    """A video's fragmented mp4, part by part: `add(frames)` encodes the next part and returns its media segment
    (moof + mdat, placed after the parts before it); `init` is the init segment (ftyp + moov), known once the first
    part is added."""

    def __init__(self, fps: int) -> None:
        self.fps = check_fps(fps)
        self.init: bytes | None = None
        self.frames = 0  # frames added so far
        self.fragments = 0  # fragments written so far (the next one's sequence number is this + 1)
        self._ticks = 0  # the track's timescale units per frame

    def add(self, frames: np.ndarray) -> bytes:
        frames = np.asarray(frames)
        if frames.ndim == 5:
            frames = frames[0]
        if not len(frames):
            return b""
        data = bytearray(encode_fragmented(frames, self.fps))
        top = boxes(data)
        kinds = [kind for kind, _, _ in top]
        if kinds[:2] != ["ftyp", "moov"]:
            raise ValueError(f"ffmpeg's fragmented mp4 starts {kinds[:2]}, not ftyp, moov")
        init = bytes(data[:top[1][1] + top[1][2]])
        if self.init is None:
            self.init = init
            mdhd = _child(data, _child(data, _child(data, top[1], "trak"), "mdia"), "mdhd")
            self._ticks = self._ticks_per_frame(data, mdhd)
        elif init != self.init:  # a different encoder setup: the first part's init would not decode this one
            raise ValueError("this part's init segment differs from the first part's: the fragments cannot join")
        out = bytearray()
        for kind, offset, size in top[2:]:
            if kind == "moof":
                self._place(data, (kind, offset, size))
            if kind in ("moof", "mdat"):
                out += data[offset:offset + size]
        self.frames += len(frames)
        return bytes(out)

    def _ticks_per_frame(self, data: bytearray, mdhd: tuple[str, int, int]) -> int:
        offset = mdhd[1] + 8
        version = data[offset]
        timescale_at = offset + 4 + (16 if version == 1 else 8)  # after version/flags and the two times
        timescale = int.from_bytes(data[timescale_at:timescale_at + 4], "big")
        if timescale % self.fps:
            raise ValueError(f"the track's timescale {timescale} is not a multiple of {self.fps} fps")
        return timescale // self.fps

    def _place(self, data: bytearray, moof: tuple[str, int, int]) -> None:
        """Move one fragment on: its sequence number after the fragments before, its decode time after the frames
        before (in place)."""
        self.fragments += 1
        mfhd = _child(data, moof, "mfhd")
        struct.pack_into(">I", data, mfhd[1] + 12, self.fragments)
        for kind, offset, size in boxes(data, moof[1] + 8, moof[1] + moof[2]):
            if kind != "traf":
                continue
            tfdt = _child(data, (kind, offset, size), "tfdt")
            at, version = tfdt[1] + 12, data[tfdt[1] + 8]
            shift = self.frames * self._ticks
            if version == 1:
                struct.pack_into(">Q", data, at, struct.unpack_from(">Q", data, at)[0] + shift)
            else:
                struct.pack_into(">I", data, at, struct.unpack_from(">I", data, at)[0] + shift)
