"""Live streams (runtime/hls.py): a segment loop's video as an HLS EVENT playlist whose MPEG-TS segments are added as
each part is decoded, from `pipe.generate(stream=DIR)`, `runtime generate --stream DIR` and the server's
`/v1/videos/{id}/stream.m3u8` routes.

How the stream is compared with the video: the frames the playlist's segments decode to (each segment fetched as a
player would, joined in order: one transport stream) against the mp4's decoded frames: the same count, each frame
within the two H.264 encodes' difference of the mp4's at its place and nearer it than any other
(`assert_same_video`); and the parts the loop hands on, joined, against the float frames it returns: equal exactly,
as each segment's frames are decoded with the VAE's memory carried."""

from __future__ import annotations

import re
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import hls

from .conftest import run_cli

PROMPT = "a lighthouse in a storm"
DF = dict(num_frames=37, overlap_history=5, steps=2, seed=3)  # 3 segments of 5, 5 and 4 latent frames (13 frames)


def decode_ts(data: bytes) -> np.ndarray:
    """uint8 frames (F, H, W, 3) of an MPEG-TS or mp4 file's bytes (ffmpeg, as a player decodes them)."""
    import imageio_ffmpeg

    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        path = Path(d) / "video"
        path.write_bytes(data)
        frames = imageio_ffmpeg.read_frames(str(path))
        w, h = next(frames)["size"]
        return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in frames])


def stream_frames(playlist: str, fetch: Callable[[str], bytes]) -> tuple[hls.Playlist, np.ndarray]:
    """The playlist parsed, and the frames of its segments (fetched by URI, relative to it) joined in order."""
    names = re.findall(r"^(stream/\d+\.ts)$", playlist, re.M)
    return hls.Playlist.parse(playlist), decode_ts(b"".join(fetch(name) for name in names))


def assert_same_video(streamed: np.ndarray, video: np.ndarray, tolerance: float = 6.0) -> None:
    """The same frames up to the codec: as many, each within a mean absolute difference of `tolerance` (of 255) of
    the video's frame at its place: two H.264 encodes of the tiny models' noisy 64x32 frames differ by 1.3-4.6.
    (Their later frames barely change, so the order is checked on frames that do: test_segments_play_in_order.)"""
    assert streamed.shape == video.shape
    per_frame = np.abs(streamed.astype(np.float32) - video.astype(np.float32)).mean(axis=(1, 2, 3))
    assert per_frame.max() <= tolerance, per_frame


def test_segments_play_in_order(tmp_path: Path) -> None:
    """HlsWriter on frames that each differ (a bar moving one step a frame): parts of 1, 8 and 12 frames become three
    segments whose joined frames are the frames given, each nearest its own place; the playlist says each one's
    length in seconds and ends only when ended; an empty part adds nothing."""
    frames = np.zeros((21, 32, 48, 3), np.float32)
    for i in range(21):
        frames[i, :, 2 * i: 2 * i + 4] = 1.0
    put = hls.directory_sink(tmp_path)
    writer = hls.HlsWriter(put, fps=8)
    assert hls.Playlist.parse((tmp_path / "stream.m3u8").read_text()) == hls.Playlist()
    for part in (frames[:1], frames[1:9], frames[9:9], frames[9:]):
        writer.add(part[None])
    text = (tmp_path / "stream.m3u8").read_text()
    assert hls.Playlist.parse(text) == hls.Playlist([1 / 8, 1.0, 1.5]) and "#EXT-X-TARGETDURATION:2" in text
    writer.end()
    playlist, got = stream_frames((tmp_path / "stream.m3u8").read_text(), lambda n: (tmp_path / n).read_bytes())
    assert playlist.ended
    want = (frames * 255).astype(np.float32)
    distance = np.abs(got.astype(np.float32)[:, None] - want[None]).mean(axis=(2, 3, 4))
    np.testing.assert_array_equal(distance.argmin(axis=1), np.arange(21))
    assert np.diagonal(distance).max() <= 3.0


@pytest.fixture(scope="module")
def df(skyreels_bundles) -> runtime.Pipeline:
    return runtime.load(skyreels_bundles["skyreels-df"])


def test_each_segment_is_decoded_as_it_ends_and_streamed(df, tmp_path: Path) -> None:
    """Diffusion forcing in three segments: `on_frames` gets each segment's new frames (13, then 12, then 12 pixel
    frames) as it ends, joining into exactly the video one decode at the end makes (`low_memory`, which decodes after
    dropping the DiT); `stream=DIR` writes a three-segment playlist, ended, whose frames are the video's."""
    from runtime.video import to_uint8, write_video

    parts: list[np.ndarray] = []
    rows: list[int] = []
    first_at: list[int] = []

    def on_frames(frames: np.ndarray) -> None:
        parts.append(frames)
        first_at.append(len(rows))

    live = df.generate(PROMPT, progress=False, on_frames=on_frames, on_step=lambda d, t: rows.append(d), **DF)
    whole = df.generate(PROMPT, progress=False, low_memory=True, **DF)
    assert [p.shape[1] for p in parts] == [17, 12, 8] and live.shape == (1, 37, 32, 64, 3)
    assert first_at[0] < len(rows) / 2  # the first part came before half the rows had run
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), live)
    np.testing.assert_array_equal(live, whole)

    streamed = df.generate(PROMPT, progress=False, stream=tmp_path / "live", **DF)
    text = (tmp_path / "live" / "stream.m3u8").read_text()
    playlist, frames = stream_frames(text, lambda name: (tmp_path / "live" / name).read_bytes())
    assert playlist.ended and len(playlist.durations) == 3 and "#EXT-X-PLAYLIST-TYPE:EVENT" in text
    assert playlist.durations == pytest.approx([17 / 24, 12 / 24, 8 / 24])
    write_video(streamed[0], tmp_path / "video.mp4", fps=24)
    mp4 = decode_ts((tmp_path / "video.mp4").read_bytes())
    assert_same_video(frames, mp4)
    truth = to_uint8(streamed[0]).astype(np.float32)  # as far from the frames made as the mp4 is, frame by frame
    error = [np.abs(v.astype(np.float32) - truth).mean(axis=(1, 2, 3)) for v in (frames, mp4)]
    assert np.all(error[0] <= error[1] + 1.5), error


def test_cli_stream_beside_out(df, tmp_path: Path) -> None:
    """`runtime generate --stream DIR` on the DF bundle: the playlist and its segments in DIR beside --out, the same
    frames; a --stream that is a file is one line, exit 2, nothing written."""
    args = ["generate", str(df.bundle.path), "--prompt", PROMPT, "--frames", "37", "--overlap-history", "5", "--steps",
            "2", "--seed", "3", "-q"]
    proc = run_cli("runtime", *args, "--out", str(tmp_path / "v.mp4"), "--stream", str(tmp_path / "live"))
    assert proc.returncode == 0, proc.stderr
    playlist, frames = stream_frames((tmp_path / "live" / "stream.m3u8").read_text(),
                                     lambda name: (tmp_path / "live" / name).read_bytes())
    assert playlist.ended and len(playlist.durations) == 3
    assert_same_video(frames, decode_ts((tmp_path / "v.mp4").read_bytes()))

    (tmp_path / "file").write_text("x")
    bad = run_cli("runtime", *args, "--out", str(tmp_path / "w.mp4"), "--stream", str(tmp_path / "file"), check=False)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--stream" in bad.stderr and "is a file" in bad.stderr and not (tmp_path / "w.mp4").exists()


def _app(tmp_path: Path, pipe: runtime.Pipeline):
    """(TestClient, State): the HTTP app on the DF bundle with a key, no worker thread (the test runs the job)."""
    from fastapi.testclient import TestClient

    from runtime.serve.jobs import open_store
    from runtime.serve.metrics import make_metrics
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State
    from runtime.serve.tenants import Keys

    state = State(settings=Settings(bundle=pipe.bundle.path, jobs_dir=tmp_path / "jobs", keys=Keys.load(None, "k")),
                  store=open_store(tmp_path / "jobs"), offer=Offer.of(pipe.manifest, "df", max_seconds=2.0))
    state.pipe = pipe
    state.metrics = make_metrics(state.store)
    state.ready.set()
    client = TestClient(create_app(state), base_url="http://127.0.0.1", headers={"Authorization": "Bearer k"})
    return client, state


class Gate:
    """Holds the worker once its first segment and the playlist naming it are stored, until the test lets it go."""

    def __init__(self, storage) -> None:
        self.put, self.written, self.go = storage.put, threading.Event(), threading.Event()
        storage.put = self

    def __call__(self, key: str, data: bytes, **kwargs: object) -> None:
        self.put(key, data, **kwargs)
        if key.endswith(".m3u8") and b"stream/0.ts" in data and not self.written.is_set():
            self.written.set()
            assert self.go.wait(60)


def _run_in_thread(state, job) -> threading.Thread:
    from runtime.serve import worker

    t = threading.Thread(target=worker._run, args=(state, job), daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("end", ["completed", "cancelled"])
def test_the_first_segment_is_served_while_the_job_runs(df, tmp_path: Path, end: str) -> None:
    """A DF job of three segments: its first segment is served while the job is in_progress (the playlist names it
    and is not ended); once completed the playlist is ended with three segments whose frames are the mp4's; cancelled
    after its first segment, the playlist ends there. Another tenant's (no key) is refused as for content; a segment
    not there is a 404; deleting the job removes the stream."""
    client, state = _app(tmp_path, df)
    created = client.post("/v1/videos", json={"prompt": PROMPT, "seconds": "1.5", "overlap_history": 5,
                                              "num_inference_steps": 2, "seed": 3})
    assert created.status_code == 200, created.text
    vid = created.json()["id"]
    waiting = client.get(f"/v1/videos/{vid}/stream.m3u8")
    assert waiting.status_code == 200 and hls.Playlist.parse(waiting.text) == hls.Playlist()
    assert waiting.headers["content-type"] == hls.PLAYLIST_TYPE
    gate = Gate(state.store.storage)
    job = state.store.claim()
    thread = _run_in_thread(state, job)
    assert gate.written.wait(120)
    try:
        assert client.get(f"/v1/videos/{vid}").json()["status"] == "in_progress"
        live = client.get(f"/v1/videos/{vid}/stream.m3u8").text
        playlist = hls.Playlist.parse(live)
        assert playlist.durations == pytest.approx([17 / 24]) and not playlist.ended and "#EXT-X-ENDLIST" not in live
        first = client.get(f"/v1/videos/{vid}/stream/0.ts")
        assert first.status_code == 200 and first.headers["content-type"] == hls.SEGMENT_TYPE
        assert decode_ts(first.content).shape == (17, 32, 64, 3)
        assert client.get(f"/v1/videos/{vid}/stream/1.ts").status_code == 404
        assert client.get(f"/v1/videos/{vid}/stream.m3u8", headers={"Authorization": ""}).status_code == 401
        if end == "cancelled":
            assert client.post(f"/v1/videos/{vid}/cancel").status_code == 200
            assert hls.Playlist.parse(client.get(f"/v1/videos/{vid}/stream.m3u8").text).ended  # at once
    finally:
        gate.go.set()
        thread.join(120)
    import httpx
    import openai

    sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="k", http_client=client)  # the README's lines
    text = sdk.get(f"/videos/{vid}/stream.m3u8", cast_to=httpx.Response).text
    playlist, frames = stream_frames(text, lambda name: client.get(f"/v1/videos/{vid}/{name}").content)
    assert playlist.ended
    if end == "cancelled":
        assert len(playlist.durations) == 1 and frames.shape == (17, 32, 64, 3)
        assert client.get(f"/v1/videos/{vid}").json()["error"]["code"] == "cancelled"
    else:
        assert client.get(f"/v1/videos/{vid}").json()["status"] == "completed"
        assert len(playlist.durations) == 3
        assert_same_video(frames, decode_ts(client.get(f"/v1/videos/{vid}/content").content))
    assert client.delete(f"/v1/videos/{vid}").status_code == 200
    assert not list((tmp_path / "jobs" / "streams").iterdir())
    assert client.get(f"/v1/videos/{vid}/stream.m3u8").status_code == 404
