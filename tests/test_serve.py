"""`runtime serve` driven with the official openai SDK: the videos API, auth, bad input, a full queue, a
SIGKILL and restart that loses nothing, a SIGTERM drain, an image-to-video job, and 2 processes x 4 devices.

Servers listen on 127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from .conftest import ROOT, devices_env, run_module, test_image
from .test_torch_free import _has_pyav, _read_ffmpeg

openai = pytest.importorskip("openai")
KEY = "sk-test-key"
# The SDK warns that OpenAI's own hosted video API closed; the API shape is what this server speaks.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, bundle: Path, jobs: Path, *extra: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.jobs = jobs
        self.log = open(jobs.parent / f"server-{self.port}-{time.time_ns()}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", "serve", str(bundle), "--port", str(self.port), "--jobs-dir", str(jobs),
             *extra], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **(env or {})})

    def wait_ready(self, timeout: float = 240) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.output()}")

    def client(self, key: str = KEY, retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=retries, timeout=60)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


@contextmanager
def serving(bundle: Path, jobs: Path, *extra: str, **kw) -> Iterator[Server]:
    server = Server(bundle, jobs, *extra, **kw)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def tiny_server(shapes_bundle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model of several shapes (conftest.SHAPES_CASE: 64x32 (default) and 32x64, 9 and 5 frames). Its key
    comes from the environment with a trailing newline, as a Kubernetes secret gives it."""
    root = tmp_path_factory.mktemp("serve")
    with serving(shapes_bundle, root / "jobs", env={"WAN_AOT_API_KEY": KEY + "\n"}) as server:
        yield server


def _mp4_frames(data: bytes, tmp: Path) -> np.ndarray:
    import imageio.v3 as iio

    path = tmp / "video.mp4"
    path.write_bytes(data)
    return iio.imread(path, plugin="pyav") if _has_pyav() else _read_ffmpeg(path)


def _wait(client: openai.OpenAI, video_id: str, status: str | tuple[str, ...], timeout: float = 120):
    statuses = (status,) if isinstance(status, str) else status
    deadline = time.time() + timeout
    while time.time() < deadline:
        video = client.videos.retrieve(video_id)
        if video.status in statuses:
            return video
        time.sleep(0.05)
    raise AssertionError(f"{video_id} did not reach {statuses} in {timeout} s (last {video.status})")


def test_create_poll_download_list_delete(tiny_server: Server, tmp_path: Path) -> None:
    client = tiny_server.client()
    video = client.videos.create_and_poll(prompt="a cat playing piano", size="64x32", seconds="0.5625",
                                          extra_body={"num_inference_steps": 3, "seed": 4}, poll_interval_ms=50)
    assert (video.status, video.progress, video.size, video.model) == ("completed", 100, "64x32", "tiny-shapes")
    assert video.object == "video" and video.error is None and video.completed_at >= video.created_at
    frames = _mp4_frames(client.videos.download_content(video.id).read(), tmp_path)
    assert frames.shape == (9, 32, 64, 3) and frames.std() > 0
    second = client.videos.create(prompt="a dog", extra_body={"num_inference_steps": 1})
    assert second.status == "queued" and second.progress == 0
    listed = [v.id for v in client.videos.list(limit=2).data]
    assert listed == [second.id, video.id]  # newest first
    page = client.videos.list(limit=1, after=second.id)
    assert [v.id for v in page.data] == [video.id]
    _wait(client, second.id, "completed")
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(video.id)


def test_api_key_is_required(tiny_server: Server) -> None:
    import httpx

    with pytest.raises(openai.AuthenticationError) as e:
        tiny_server.client(key="wrong").videos.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.get(tiny_server.url + "/v1/videos").status_code == 401
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}


def test_a_key_ending_in_a_newline_is_the_key_without_it(tiny_server: Server) -> None:
    """Issue 43, finding 8: WAN_AOT_API_KEY="KEY\\n" (a secret file's usual last byte) used to make every request a
    401; the key is the text without the whitespace around it. A key that is blank or holds spaces is refused at
    start, in one line."""
    from .conftest import run_cli

    assert tiny_server.client(key=KEY).videos.list().data is not None
    for given, message in (("\n", "--api-key (or WAN_AOT_API_KEY) is empty"),
                           ("two words", "--api-key (or WAN_AOT_API_KEY) holds spaces or characters a client cannot")):
        proc = run_cli("runtime", "serve", "nowhere", "--api-key", given, check=False)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
        assert proc.stderr.count("\n") == 1 and "two words" not in proc.stderr  # one line; the key not echoed


@pytest.mark.parametrize("fields,param,message", [
    ({"size": "128x128"}, "size", "size '128x128' is not one this bundle makes: it makes 64x32, 32x64"),
    ({"seconds": "8"}, "seconds", "seconds '8' is not a duration this bundle makes at 64x32: it makes 9 frames "
                                  "(0.5625 s) or 5 frames (0.3125 s) at 16 fps"),
    ({"size": "32x64", "seconds": "0.4"}, "seconds", "seconds '0.4' is not a duration this bundle makes at 32x64"),
    # seconds are durations at the bundle's frame rate, whatever fps the mp4 is written at
    ({"size": "32x64", "seconds": "0.625", "fps": 8}, "seconds", "seconds '0.625' is not a duration this bundle makes "
                                                                 "at 32x64: it makes 9 frames (0.5625 s) or 5 frames "
                                                                 "(0.3125 s) at 16 fps"),
    ({"size": "64X32"}, "size", "size '64X32' is not one this bundle makes"),
    # the API's names for the run settings, not the CLI's (steps, guidance, guidance_2, flow shift)
    ({"num_inference_steps": 0}, "num_inference_steps", "num_inference_steps must be an integer in 1..1000, got 0"),
    ({"num_inference_steps": 1001}, "num_inference_steps", "num_inference_steps must be an integer in 1..1000"),
    ({"num_inference_steps": "lots"}, "num_inference_steps", "num_inference_steps must be an integer"),
    ({"guidance_scale": -1}, "guidance_scale", "guidance_scale must be a finite number >= 0, got -1"),
    ({"guidance_scale_2": 3}, "guidance_scale_2", "guidance_scale_2 is for two-expert models; this bundle is Wan 2.1 "
                                                  "text-to-video with one expert: use guidance_scale"),
    ({"seed": -1}, "seed", "seed must be an integer in 0..4294967295"),
    ({"flow_shift": 1e-30}, "flow_shift", "flow_shift must be a finite number in 0.01..100, got 1e-30"),
    ({"fps": 0}, "fps", "fps must be an integer in 1..240"),
    ({"prompt": ""}, "prompt", "prompt is required"),
    ({"prompt": " \n"}, "prompt", "prompt is required"),
    ({"negative_prompt": "x" * 20_001}, "negative_prompt", "negative_prompt is longer than 20000 characters"),
    ({"model": "sora-2"}, "model", "model 'sora-2' is not served here"),
    ({"sampler": "ddim"}, "sampler", "sampler 'ddim' is not one of unipc, euler, dpm++"),
    ({"sigmas": [1.5, 0.5]}, "sigmas", "sigmas must be"),
    ({"sigmas": [1, 0.5], "num_inference_steps": 2}, "sigmas", "give sigmas or num_inference_steps, not both"),
    ({"colour": "red"}, "colour", "unknown field"),
])
def test_bad_input_is_a_400_naming_the_field(tiny_server: Server, fields: dict, param: str, message: str) -> None:
    import httpx

    body = {"prompt": "a cat", **fields}
    r = httpx.post(tiny_server.url + "/v1/videos", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:  # the same through the SDK's multipart form
        tiny_server.client().videos.create(prompt=body.pop("prompt"), extra_body=body)
    assert e.value.body["param"] == param


def test_more_sigmas_than_steps_are_refused_as_sent(tiny_server: Server) -> None:
    """The document's maxItems counts the items sent, so the server does too: repeated levels are not merged first
    (schemathesis sent three equal sigmas to a two-step server and had them accepted)."""
    import httpx

    r = httpx.post(tiny_server.url + "/v1/videos", json={"prompt": "a cat", "sigmas": [0.5] * 1001},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sigmas", r.text
    assert r.json()["error"]["message"] == "sigmas: 1001 levels, more than this server runs (1000 steps)"
    with pytest.raises(openai.BadRequestError) as e:  # the form's comma-separated text
        tiny_server.client().videos.create(prompt="a cat", extra_body={"sigmas": ",".join(["0.5"] * 1001)})
    assert e.value.body["param"] == "sigmas"


def test_a_sampler_and_sigmas_make_the_clis_video(tiny_server: Server, shapes_bundle: Path, tmp_path: Path) -> None:
    """`sampler` and `sigmas` (a JSON list; in the SDK's form, comma-separated text) run as the CLI's flags do."""
    import httpx

    run_module("runtime", "generate", str(shapes_bundle), "--prompt", "a kite", "--sampler", "euler", "--sigmas",
               "1,0.6", "--seed", "3", "--out", str(tmp_path / "cli.mp4"), "-q")
    cli = _mp4_frames((tmp_path / "cli.mp4").read_bytes(), tmp_path).astype(np.int16)
    client = tiny_server.client()
    r = httpx.post(tiny_server.url + "/v1/videos", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "a kite", "sampler": "euler", "sigmas": [0.6, 1], "seed": 3})  # any order
    assert r.status_code == 200, r.text
    form = client.videos.create(prompt="a kite", extra_body={"sampler": "euler", "sigmas": "1,0.6", "seed": 3})
    unipc = client.videos.create(prompt="a kite", extra_body={"sigmas": "1,0.6", "seed": 3})
    for video_id, same in ((r.json()["id"], True), (form.id, True), (unipc.id, False)):
        assert _wait(client, video_id, ("completed", "failed")).status == "completed"
        served = _mp4_frames(client.videos.download_content(video_id).read(), tmp_path).astype(np.int16)
        assert (np.abs(served - cli).max() <= 1) == same


def test_portrait_and_landscape_from_one_server(tiny_server: Server, tmp_path: Path) -> None:
    """`size` picks the resolution and `seconds` the frame count (at the request's fps); the job reports what it
    makes; /v1/models lists the shapes."""
    import httpx

    client = tiny_server.client()
    models = client.models.list()
    (card,) = models.data
    shapes = card.model_extra["shapes"]
    assert [(s["size"], s["frames"], s["default"]) for s in shapes] == [
        ("64x32", 9, True), ("64x32", 5, False), ("32x64", 9, False), ("32x64", 5, False)]
    assert card.id == "tiny-shapes" and shapes[1]["seconds"] == "0.3125" and card.owned_by == "wan-aot"
    assert httpx.get(tiny_server.url + "/v1/models").status_code == 401  # behind the key like the rest
    tall = client.videos.create(prompt="a tall tower", size="32x64", seconds="0.3125",
                                extra_body={"num_inference_steps": 2, "seed": 1})
    wide = client.videos.create(prompt="a wide beach", size="64x32", extra_body={"num_inference_steps": 2})
    slow = client.videos.create(prompt="a tall tower", size="32x64", seconds="0.3125",
                                extra_body={"num_inference_steps": 2, "fps": 8})  # 5 frames, played at 8 fps
    assert (tall.size, tall.seconds, wide.size, wide.seconds) == ("32x64", "0.3125", "64x32", "0.5625")
    assert slow.seconds == "0.625"  # what it makes: 5 frames at 8 fps
    for video, shape in ((tall, (5, 64, 32, 3)), (wide, (9, 32, 64, 3)), (slow, (5, 64, 32, 3))):
        done = _wait(client, video.id, ("completed", "failed"))
        assert done.status == "completed", (done.error, tiny_server.output())
        assert _mp4_frames(client.videos.download_content(video.id).read(), tmp_path).shape == shape


def test_image_for_a_text_only_bundle_and_limits(tiny_server: Server, tmp_path: Path) -> None:
    import httpx

    png = tmp_path / "x.png"
    test_image(40, 30).save(png)
    with pytest.raises(openai.BadRequestError) as e:
        tiny_server.client().videos.create(prompt="a cat", input_reference=png.open("rb"))
    assert e.value.body["param"] == "input_reference" and "takes no image" in e.value.body["message"]
    r = httpx.post(tiny_server.url + "/v1/videos", json={"prompt": 5}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # a prompt of the wrong type
    r = httpx.post(tiny_server.url + "/v1/videos", content=b"{not json", headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    from runtime.serve.schema import MAX_BODY_BYTES

    r = httpx.post(tiny_server.url + "/v1/videos", headers={"Authorization": f"Bearer {KEY}"},
                   content=b" " * (MAX_BODY_BYTES + 1))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_image_to_video_through_input_reference(kind_bundles, tmp_path: Path) -> None:
    """An image-to-video job with the image as a multipart file (the SDK's input_reference) and as JSON
    {"image_url": "data:..."} (the same video); any other URL is refused (the server fetches nothing). On its result:
    an extension (the source, then the new frames from its last one), a remix and an edit of an upload (the source
    noised at `strength`), through the SDK (this kind's documents are fuzzed in tests/test_api_kinds.py)."""
    import base64

    import httpx

    png, notes = tmp_path / "first.png", tmp_path / "notes.png"
    test_image(70, 50).save(png)
    notes.write_text("not an image")
    with serving(kind_bundles["i2v"], tmp_path / "jobs", "--max-steps", "2") as server:
        client = server.client(key="unused")
        video = client.videos.create_and_poll(prompt="a robot", input_reference=png.open("rb"),
                                              extra_body={"num_inference_steps": 2}, poll_interval_ms=50)
        assert video.status == "completed", video.error
        frames = _mp4_frames(client.videos.download_content(video.id).read(), tmp_path).astype(int)
        assert frames.shape == (9, 32, 48, 3)
        for kwargs, message in (({}, "needs an image"), ({"input_reference": notes.open("rb")}, "not an image")):
            with pytest.raises(openai.BadRequestError) as e:
                client.videos.create(prompt="a robot", **kwargs)
            assert e.value.body["param"] == "input_reference" and message in e.value.body["message"]
        url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
        r = httpx.post(server.url + "/v1/videos", json={"prompt": "a robot", "num_inference_steps": 2,
                                                        "input_reference": {"image_url": url}})
        assert r.status_code == 200, r.text
        same = _mp4_frames(client.videos.download_content(_wait(client, r.json()["id"], "completed").id).read(),
                           tmp_path).astype(int)
        assert np.abs(same - frames).max() <= 1
        r = httpx.post(server.url + "/v1/videos", json={"prompt": "a robot",
                                                        "input_reference": {"image_url": "https://example.com/a.png"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"
        assert "the server fetches nothing" in r.json()["error"]["message"]

        longer = client.videos.extend(prompt="the robot walks on", seconds="0.5625", video=openai.omit,
                                      extra_body={"video": {"id": video.id}})
        longer = _wait(client, longer.id, ("completed", "failed"))
        assert (longer.status, longer.seconds, longer.remixed_from_video_id) == ("completed", "1.0625", video.id)
        extended = _mp4_frames(client.videos.download_content(longer.id).read(), tmp_path).astype(int)
        assert extended.shape == (17, 32, 48, 3)  # 9, then 9 new ones from the last: that frame once
        assert np.abs(extended[:9] - frames).mean() < 3  # the source's frames (encoded once more)
        remix = _wait(client, client.videos.remix(video.id, prompt="a robot dancing",
                                                  extra_body={"strength": 0.6}).id, ("completed", "failed"))
        with open(tmp_path / "upload.mp4", "wb") as f:
            f.write(client.videos.download_content(longer.id).read())
        with open(tmp_path / "upload.mp4", "rb") as f:
            edit = _wait(client, client.videos.edit(prompt="a robot dancing", video=f).id, ("completed", "failed"))
        for made, source in ((remix, video.id), (edit, None)):
            assert (made.status, made.remixed_from_video_id, made.seconds) == ("completed", source, "0.5625")
            assert np.abs(_mp4_frames(client.videos.download_content(made.id).read(), tmp_path).astype(int)
                          - frames).max() > 8  # remade, not copied


def test_a_full_queue_answers_429_with_retry_after(fp32_bundles, tmp_path: Path) -> None:
    with serving(fp32_bundles["tiny-64x32-f9"], tmp_path / "jobs", "--queue-size", "1") as server:
        client = server.client(key="unused")
        slow = {"num_inference_steps": 600}  # the server is killed at the end: no one waits for these
        first = client.videos.create(prompt="a", extra_body=slow)
        _wait(client, first.id, "in_progress")
        client.videos.create(prompt="b", extra_body=slow)  # waits in the queue
        with pytest.raises(openai.RateLimitError) as e:
            client.videos.create(prompt="c", extra_body=slow)
        assert e.value.status_code == 429 and int(e.value.response.headers["Retry-After"]) > 0
        assert e.value.body["code"] == "queue_full"
        import httpx

        metrics = httpx.get(server.url + "/metrics").text
        assert "wan_aot_queue_depth 1.0" in metrics and 'wan_aot_jobs{status="in_progress"} 1.0' in metrics
        assert "wan_aot_step_seconds_bucket" in metrics and "wan_aot_request_seconds_count" in metrics


def test_sigkill_mid_job_then_restart_loses_nothing(fp32_bundles, tmp_path: Path) -> None:
    bundle, jobs = fp32_bundles["tiny-64x32-f9"], tmp_path / "jobs"
    server = Server(bundle, jobs)
    try:
        server.wait_ready()
        client = server.client(key="unused")
        done = client.videos.create_and_poll(prompt="done before", extra_body={"num_inference_steps": 1},
                                             poll_interval_ms=50)
        running = client.videos.create(prompt="killed while running", extra_body={"num_inference_steps": 150})
        queued = [client.videos.create(prompt=f"queued {i}", extra_body={"num_inference_steps": 2}) for i in range(2)]
        assert _wait(client, running.id, "in_progress").progress < 100
    finally:
        server.stop(signal.SIGKILL)
    assert not list((jobs / "videos").glob(f"{running.id}*.mp4"))
    with serving(bundle, jobs) as again:
        client = again.client(key="unused")
        assert client.videos.retrieve(done.id).status == "completed"
        assert len(client.videos.download_content(done.id).read()) > 0
        for video in (running, *queued):
            assert _wait(client, video.id, ("completed", "failed"), timeout=180).status == "completed"
        assert "was running when the server stopped: queued again" in again.output()


def test_sigterm_drains_then_exits(fp32_bundles, tmp_path: Path) -> None:
    import httpx

    from runtime.serve.jobs import open_store

    server = Server(fp32_bundles["tiny-64x32-f9"], tmp_path / "jobs")
    try:
        server.wait_ready()
        client = server.client(key="unused")
        running = client.videos.create(prompt="finish me", extra_body={"num_inference_steps": 600})  # ~10 s
        waiting = client.videos.create(prompt="stay queued", extra_body={"num_inference_steps": 2})
        _wait(client, running.id, "in_progress")
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(server.url + "/v1/videos", json={"prompt": "too late"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert httpx.get(server.url + "/ready").status_code == 503
        assert server.proc.wait(timeout=120) == 0
    finally:
        server.stop(signal.SIGKILL)
    store = open_store(tmp_path / "jobs")
    assert store.get(running.id).status == "completed" and store.storage.exists(store.get(running.id).video)
    assert store.get(waiting.id).status == "queued"  # not lost: it runs at the next start
    assert [j.prompt for j in store.list(10)[0]] == ["stay queued", "finish me"]


def test_non_loopback_needs_a_key(fp32_bundles, tmp_path: Path) -> None:
    proc = run_module("runtime", "serve", str(fp32_bundles["tiny-64x32-f9"]), "--host", "0.0.0.0",
                      "--jobs-dir", str(tmp_path / "jobs"), check=False, env={"WAN_AOT_API_KEY": ""})
    assert proc.returncode == 2 and "set --api-key (or WAN_AOT_API_KEY) or --api-keys FILE, or pass --insecure" in \
        proc.stderr
    assert not (tmp_path / "jobs").exists()


def test_a_missing_bundle_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Not a server that answers "still loading" forever: the bundle is read before anything serves."""
    proc = run_module("runtime", "serve", str(tmp_path / "nope"), "--port", str(_free_port()), "--jobs-dir",
                      str(tmp_path / "jobs"), check=False, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"error: {tmp_path / 'nope'} is not a bundle directory: pass the " \
                                                   "directory `python -m export` wrote\n", proc.stderr
    assert not (tmp_path / "jobs").exists()


def test_a_port_in_use_is_one_line_and_exit_2(fp32_bundles, tmp_path: Path) -> None:
    """The port is bound before anything loads: one line, exit 2 (never 3, which asks a supervisor to restart)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_module("runtime", "serve", str(fp32_bundles["tiny-64x32-f9"]), "--port", str(port), "--jobs-dir",
                          str(tmp_path / "jobs"), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: port {port} on 127.0.0.1 is in use: Address already in use (stop what listens " \
                          "there, or pass another --port)\n", proc.stderr
    assert not (tmp_path / "jobs").exists()  # nothing opened, nothing loaded


def test_a_bundle_that_fails_to_load_stops_the_server(fp32_bundles, tmp_path: Path) -> None:
    """A weight file damaged after export is found while loading: no job could ever run, so the server logs one line
    and exits with status 4 (not 3, the stall that a restart may cure), instead of serving "still loading"."""
    import shutil

    bundle = tmp_path / "damaged"
    shutil.copytree(fp32_bundles["tiny-64x32-f9"], bundle)
    weights = bundle / "weights" / "vae.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    server = Server(bundle, tmp_path / "jobs")
    try:
        assert server.proc.wait(timeout=180) == 4, server.output()
    finally:
        server.stop(signal.SIGKILL)
    log = Path(server.log.name).read_text()
    failed = [line for line in log.splitlines() if "could not load" in line]
    assert failed == [f"runtime: could not load {bundle}: BundleError: bundle file weights/vae.safetensors does not "
                      "match its sha256 in the manifest (tampered or truncated): re-copy or re-export the bundle; "
                      "stopping (no job could run)"], log
    assert "Traceback" not in log and "RuntimeError" not in log, log


def test_serve_flags(tmp_path: Path) -> None:
    import re

    from .conftest import run_cli

    usage = run_cli("runtime", "serve", "--help").stdout
    assert re.search(r"--port PORT\s+port to listen on \(default 8000\)", usage), usage
    proc = run_cli("runtime", "serve", str(tmp_path), "--max-steps", "0", check=False)
    assert (proc.returncode, proc.stderr) == (2, "error: --max-steps 0 must be in 1..1000\n")


def test_the_default_jobs_dir_is_git_ignored() -> None:
    for path in ("jobs/jobs.sqlite3", "jobs/videos/video_1.mp4"):
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        if proc.returncode == 128:
            pytest.skip("not a git checkout")
        assert proc.returncode == 0, path  # 1: `python -m runtime serve` in the checkout leaves jobs/ untracked


def test_refused_requests_are_labelled_with_their_route_and_405_says_allow(tiny_server: Server) -> None:
    """/metrics labels a request the middleware answered (a 401 before routing) with the route it was for, `other`
    only for a path no route has; methods outside HTTP's are one `other` label; a 405 lists the methods in Allow;
    a body neither JSON nor a form is a 415."""
    import httpx

    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(tiny_server.url + "/v1/videos").status_code == 401
    assert httpx.request("BREW", tiny_server.url + "/v1/models").status_code == 401
    assert httpx.get(tiny_server.url + "/nowhere", headers=auth).status_code == 404
    r = httpx.request("PUT", tiny_server.url + "/v1/videos/video_x", headers=auth)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(tiny_server.url + "/v1/videos", content=b"prompt=a", headers={
        **auth, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    metrics = httpx.get(tiny_server.url + "/metrics").text
    for labels in ('method="GET",route="/v1/videos",status="401"', 'method="other",route="/v1/models",status="401"',
                   'method="GET",route="other",status="404"', 'method="PUT",route="/v1/videos/{video_id}",status="405"',
                   'method="POST",route="/v1/videos",status="415"'):
        assert f"wan_aot_request_seconds_count{{{labels}}}" in metrics, labels
    assert 'method="BREW"' not in metrics


def test_two_processes_serve_one_mesh(cpu8_bundle: Path, tmp_path: Path) -> None:
    """Process 0 serves and owns the queue; process 1 runs each broadcast job with it (2 x 4 CPU devices), in each
    of the bundle's shapes (the broadcast carries the job's shape: cpu8_bundle has a portrait one), with the live
    preview (a global array every process reads); a job cancelled while it runs stops on both processes at the same
    step (else the next job's collectives would never meet)."""
    bundle = cpu8_bundle
    coordinator = f"127.0.0.1:{_free_port()}"
    env = devices_env(4)
    multi = ("--coordinator", coordinator, "--num-processes", "2")
    follower = Server(bundle, tmp_path / "jobs-1", *multi, "--process-id", "1", env=env)
    leader = Server(bundle, tmp_path / "jobs", *multi, "--process-id", "0", env=env)
    try:
        leader.wait_ready()
        client = leader.client(key="unused")
        for seed, size, shape in ((1, "64x32", (9, 32, 64, 3)), (2, "32x64", (9, 64, 32, 3))):
            video = client.videos.create_and_poll(prompt="a robot dancing", poll_interval_ms=50, size=size,
                                                  extra_body={"num_inference_steps": 2, "seed": seed})
            assert video.status == "completed", (video.error, leader.output(), follower.output())
            assert _mp4_frames(client.videos.download_content(video.id).read(), tmp_path).shape == shape
        slow = client.videos.create(prompt="stopped on both", extra_body={"num_inference_steps": 400})
        _running(client, slow.id)
        client.post(f"/videos/{slow.id}/cancel", cast_to=openai.types.Video)
        after = client.videos.create_and_poll(prompt="the next one", poll_interval_ms=50,
                                              extra_body={"num_inference_steps": 2})
        assert after.status == "completed", (after.error, leader.output(), follower.output())
        assert "stopped with process 0" in follower.output()
        assert leader.stop(signal.SIGTERM) == 0
        assert follower.proc.wait(timeout=60) == 0, follower.output()
        assert not (tmp_path / "jobs-1").exists()  # only process 0 owns a job store
    finally:
        leader.stop(signal.SIGKILL)
        follower.stop(signal.SIGKILL)


def test_server_defaults_magcache_and_lora_adapters(kind_bundles, kind_checkpoints, tmp_path: Path) -> None:
    """`serve --magcache R --lora A` on a two-expert bundle: every job runs with them (the adapter on the second
    expert), so a job's video is the CLI's with the same flags, and not the plain one."""
    import json

    from .test_lora import diffusers_lora

    bundle = kind_bundles["t2v-moe"]
    lora = diffusers_lora(kind_checkpoints["t2v-moe"], tmp_path / "lora", seed=8, subfolder="transformer_2")
    adapter = tmp_path / "low.safetensors"
    run_module("export", "lora", str(lora), "--bundle", str(bundle), "--out", str(adapter), "--lora-into",
               "transformer_2")
    ratios = tmp_path / "ratios.json"
    ratios.write_text(json.dumps([1.0] * 4))
    flags = ("--magcache", str(ratios), "--magcache-retention", "0", "--lora", f"{adapter}:0.9")
    videos = {}
    for name, extra in (("cli", flags), ("plain", ())):
        run_module("runtime", "generate", str(bundle), "--prompt", "a kite", "--steps", "4", *extra,
                   "--out", str(tmp_path / f"{name}.mp4"))
        videos[name] = _mp4_frames((tmp_path / f"{name}.mp4").read_bytes(), tmp_path).astype(np.int16)
    with serving(bundle, tmp_path / "jobs", *flags) as server:
        client = server.client(key="unused")
        video = client.videos.create_and_poll(prompt="a kite", extra_body={"num_inference_steps": 4},
                                              poll_interval_ms=50)
        assert video.status == "completed", video.error
        served = _mp4_frames(client.videos.download_content(video.id).read(), tmp_path).astype(np.int16)
    assert np.abs(served - videos["cli"]).max() <= 1
    assert np.abs(served - videos["plain"]).max() > 1


# -- cancel, previews, remix ----------------------------------------------------------------------------------------
SLOW = {"num_inference_steps": 1000}  # ~10 s of steps on the tiny model: a job that is still running when asked


def _running(client: openai.OpenAI, video_id: str, timeout: float = 120):
    """The job once it has made a step of progress (in progress, and its first step written)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        video = client.videos.retrieve(video_id)
        if video.status == "in_progress" and video.progress >= 1:
            return video
        assert video.status in ("queued", "in_progress"), (video.status, video.error)
        time.sleep(0.05)
    raise AssertionError(f"{video_id} did not start in {timeout} s")


def _log_until(server: Server, text: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = Path(server.log.name).read_text()
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the log in {timeout} s:\n{server.output()}")


def _stopped_after(log: str, video_id: str) -> int:
    import re

    return int(re.search(rf"job {video_id}: cancelled by a client; stopped after (\d+) denoising steps", log)[1])


def test_cancel_and_delete_stop_a_running_job_and_a_queued_one_never_runs(tiny_server: Server) -> None:
    """POST .../cancel of a running job: it stops within one step of the cancel (progress counts steps by the
    percent: 1000 steps, 10 a point), stays failed with code `cancelled`, stores nothing, and the next job starts; a
    queued job cancelled never runs; DELETE of a running job stops it too and leaves nothing; the replica counts
    them."""
    import httpx

    client = tiny_server.client()
    running = client.videos.create(prompt="cancel me", extra_body=SLOW)
    queued = client.videos.create(prompt="cancel me before I run", extra_body=SLOW)
    following = client.videos.create(prompt="the next job", extra_body={"num_inference_steps": 2})
    _running(client, running.id)
    cancelled = client.post(f"/videos/{queued.id}/cancel", cast_to=openai.types.Video)  # queued: never runs
    assert (cancelled.status, cancelled.error.code) == ("failed", "cancelled")
    at_cancel = client.post(f"/videos/{running.id}/cancel", cast_to=openai.types.Video)
    assert (at_cancel.status, at_cancel.error.code) == ("failed", "cancelled") and at_cancel.progress < 100
    log = _log_until(tiny_server, f"job {running.id}: cancelled by a client")
    assert _stopped_after(log, running.id) <= 10 * at_cancel.progress + 10  # the step in flight, and no other
    assert _wait(client, following.id, ("completed", "failed")).status == "completed"  # the next job ran
    assert f"job {queued.id}: started" not in Path(tiny_server.log.name).read_text()
    after = client.videos.retrieve(running.id)
    assert (after.status, after.error.code, after.progress) == ("failed", "cancelled", at_cancel.progress)
    for video_id in (running.id, queued.id):
        with pytest.raises(openai.ConflictError):  # nothing to download
            client.videos.download_content(video_id)
        assert not list((tiny_server.jobs / "videos").glob(f"{video_id}*"))
    with pytest.raises(openai.ConflictError) as e:  # ended already
        client.post(f"/videos/{following.id}/cancel", cast_to=openai.types.Video)
    assert e.value.body["code"] == "video_not_cancellable"
    with pytest.raises(openai.NotFoundError):
        client.post("/videos/video_nope/cancel", cast_to=openai.types.Video)
    deleted = client.videos.create(prompt="delete me while I run", extra_body=SLOW)
    _running(client, deleted.id)
    assert client.videos.delete(deleted.id).deleted
    _log_until(tiny_server, f"job {deleted.id}: cancelled by a client")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(deleted.id)
    assert not list((tiny_server.jobs / "videos").glob(f"{deleted.id}*"))
    assert not list((tiny_server.jobs / "previews").glob(f"{deleted.id}*"))
    metrics = httpx.get(tiny_server.url + "/metrics").text
    assert 'wan_aot_replica_jobs_total{outcome="cancelled"} 2.0' in metrics


def test_a_running_jobs_thumbnail_is_its_live_preview_then_the_first_frame(tiny_server: Server,
                                                                          tmp_path: Path) -> None:
    """While a job runs, variant=thumbnail is a WebP at the video's size that changes between steps; when it has
    completed, the thumbnail is the mp4's first frame (within the codecs' tolerance) and the spritesheet its frames
    in the documented grid (thumbnails.py)."""
    from PIL import Image

    from runtime.serve import thumbnails

    client = tiny_server.client()
    job = client.videos.create(prompt="a preview of a fox", size="32x64", extra_body=SLOW)
    _running(client, job.id)
    seen = []
    deadline = time.time() + 60
    while len(seen) < 2 and time.time() < deadline:  # two previews of different steps
        try:
            data = client.videos.download_content(job.id, variant="thumbnail").read()
        except openai.ConflictError:  # its first preview is still being stored
            continue
        image = Image.open(io.BytesIO(data))
        assert image.format == "WEBP" and image.size == (32, 64)
        pixels = np.asarray(image.convert("RGB")).astype(int)
        if not seen or np.abs(pixels - seen[-1]).max() > 0:
            seen.append(pixels)
        time.sleep(0.05)
    assert len(seen) == 2, "the live preview did not change between steps"
    client.videos.delete(job.id)
    video = client.videos.create_and_poll(prompt="a finished fox", extra_body={"num_inference_steps": 2},
                                          poll_interval_ms=50)
    frames = _mp4_frames(client.videos.download_content(video.id).read(), tmp_path).astype(int)
    thumb = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").read()))
    assert thumb.format == "WEBP" and thumb.size == (64, 32)
    difference = np.abs(np.asarray(thumb.convert("RGB")).astype(int) - frames[0])
    assert difference.mean() < 4 and difference.max() < 48, (difference.mean(), difference.max())
    sheet = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="spritesheet").read()))
    n, columns, rows, tw, th = thumbnails.spritesheet_geometry(9, 64, 32)
    assert sheet.format == "JPEG" and sheet.size == (columns * tw, rows * th) == (192, 96)
    tiles = np.asarray(sheet.convert("RGB")).astype(int)
    for k, index in enumerate(thumbnails.sprite_indices(9)):
        tile = tiles[(k // columns) * th:(k // columns + 1) * th, (k % columns) * tw:(k % columns + 1) * tw]
        assert np.abs(tile - frames[index]).mean() < 6, k
    with pytest.raises(openai.BadRequestError):
        client.videos.download_content(video.id, variant="poster")


def test_remix_and_edit_on_a_text_to_video_bundle(tiny_server: Server, tmp_path: Path) -> None:
    """Without a VAE encoder a remix is the source's seed and settings with the new prompt: the same prompt makes the
    same video, another prompt another; `remixed_from_video_id` names the source; an edit of a completed video by id
    (the SDK's extra_body, sent as the form field video[id]) is the same; an upload, an extension, a source that has
    not completed and another tenant's (unknown: 404) are refused, each naming the field."""
    import httpx

    client = tiny_server.client()
    source = client.videos.create_and_poll(prompt="a lighthouse at night", size="32x64", seconds="0.3125",
                                           extra_body={"num_inference_steps": 2, "seed": 5}, poll_interval_ms=50)
    same = _wait(client, client.videos.remix(source.id, prompt="a lighthouse at night").id, ("completed", "failed"))
    other = _wait(client, client.videos.edit(prompt="a castle at dawn", video=openai.omit,
                                             extra_body={"video": {"id": source.id}}).id, ("completed", "failed"))
    for video in (same, other):
        assert (video.status, video.remixed_from_video_id, video.size, video.seconds) == (
            "completed", source.id, "32x64", "0.3125"), video.error
    frames = {v.id: _mp4_frames(client.videos.download_content(v.id).read(), tmp_path).astype(int)
              for v in (source, same, other)}
    assert np.abs(frames[same.id] - frames[source.id]).max() <= 1  # the source's seed and settings
    assert np.abs(frames[other.id] - frames[source.id]).max() > 8  # the new prompt
    upload = ("v.mp4", io.BytesIO(client.videos.download_content(source.id).read()), "video/mp4")
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.edit(prompt="a castle", video=upload)
    assert e.value.body["param"] == "video" and "without a VAE encoder" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.extend(prompt="more", seconds="0.5625", video=openai.omit,
                             extra_body={"video": {"id": source.id}})
    assert e.value.body["message"].endswith("(the kinds that extend: ti2v, i2v, i2v-moe, vace, vace-moe, "
                                            "skyreels-i2v, skyreels-df, helios, helios-pyramid, helios-distilled)")
    busy = client.videos.create(prompt="not yet", extra_body=SLOW)
    with pytest.raises(openai.ConflictError) as e:
        client.videos.remix(busy.id, prompt="too soon")
    assert e.value.body["code"] == "video_not_ready"
    client.videos.delete(busy.id)
    for path in ("/v1/videos/video_nope/remix", "/v1/videos/edits"):
        r = httpx.post(tiny_server.url + path, headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": "x", **({"video": {"id": "video_nope"}} if "edits" in path else {})})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = httpx.post(tiny_server.url + f"/v1/videos/{source.id}/remix", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "x", "strength": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "strength"


def test_ctrl_c_in_generate_leaves_no_file(fp32_bundles, tmp_path: Path) -> None:
    """SIGINT (the terminal's Ctrl-C, to the whole process group) while `runtime generate` denoises: it stops with
    one line and status 130, and no mp4 (nor a partial one) is left."""
    out = tmp_path / "out" / "video.mp4"
    out.parent.mkdir()
    # SIGINT's Python handler put back first: a shell's background job (`pytest ... &`) starts with SIGINT ignored,
    # which the child would inherit (and, rightly, keep), so the test would not test Ctrl-C
    interruptible = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "sys.argv[0] = 'runtime'; runpy.run_module('runtime', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", interruptible, "generate", str(fp32_bundles["tiny-64x32-f9"]),
                             "--prompt", "a fox", "--steps", "10000", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    try:
        seen = b""
        deadline = time.time() + 180
        while b"denoising:" not in seen and time.time() < deadline:  # tqdm's bar: the steps are running
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, proc.wait()
            seen += chunk
        assert b"denoising:" in seen
        # Ctrl-C, pressed again while the run goes on: Python drops a KeyboardInterrupt raised inside a gc callback
        # ("Exception ignored in: <function _xla_gc_callback ...>"), so one SIGINT can land where it is lost
        for _ in range(5):
            os.killpg(proc.pid, signal.SIGINT)
            try:
                _, rest = proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = (seen + rest).decode()
    stderr = re.sub(r"Exception ignored in: <function _xla_gc_callback.*?KeyboardInterrupt: *\n", "", stderr,
                    flags=re.S)  # the lost one, above
    assert proc.returncode == 130 and stderr.rstrip().endswith("error: interrupted"), stderr[-2000:]
    assert "Traceback" not in stderr and list(out.parent.iterdir()) == []
