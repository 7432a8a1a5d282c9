"""The realtime session (GET /v1/realtime/video, runtime/serve/realtime.py) on a served tiny AnyFlow-FAR bundle
(tiny-anyflow-far at 64x32 x 25 frames: chunks of 1, 8, 8, 8 frames), driven by the `websockets` package's sync client
on 127.0.0.1.

What a session sends is the Python API's video: its fragments are byte for byte the fMP4 runtime/fmp4.py makes of
far.stream's chunks with the same seed, settings and prompt change (so each chunk is the chunk far.stream made, up to
the codec), and decoded they are pipe.generate's frames with prompt_changes within a PSNR bound. A prompt update reaches
the next chunk not yet started; bad events are answered and the connection stays usable; an oversize message closes
it with 1009; 401 and 404 come before the upgrade is accepted; a client that goes away stops its session (the slot
freed: the /v1/videos job it held back runs, another session starts); the metrics count sessions and chunks."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from .test_anyflow_far import far  # noqa: F401  (the tiny FAR checkpoint and bundle, shared with that file)
from .test_serve import KEY, Server, serving

websockets = pytest.importorskip("websockets")
from websockets.sync.client import connect  # noqa: E402

W, H, FRAMES = 64, 32, 25
PROMPT, NEGATIVE, OTHER = "a red cat", "blurry", "a blue dog"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW_STEPS = 1000  # about half a second a chunk here: a session that runs past the length limit
# The SDK warns that OpenAI's own hosted video API closed; the API shape is what this server speaks.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def server(far: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # noqa: F811
    root = tmp_path_factory.mktemp("realtime")
    with serving(far[1], root / "jobs", "--api-key", KEY, "--realtime-max-message-kb", "4") as server:
        yield server


@pytest.fixture(scope="module")
def pipe(far: tuple[Path, Path]):  # noqa: ANN201, F811
    import runtime

    return runtime.load(far[1])


def _url(server: Server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime/video"


def _start(ws, **settings: object) -> None:
    ws.send(json.dumps({"type": "session.start", "session": {"prompt": PROMPT, "negative_prompt": NEGATIVE,
                                                             "size": f"{W}x{H}", **settings}}))


def _event(ws) -> dict:
    message = ws.recv(timeout=60)
    assert isinstance(message, str), f"a binary message where an event was due ({len(message)} bytes)"
    return json.loads(message)


def _metric(server: Server, name: str) -> float:
    import httpx

    text = httpx.get(server.url + "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def _decode(data: bytes, tmp: Path) -> np.ndarray:
    """The frames ffmpeg decodes from a fragmented mp4 (uint8, (F, H, W, 3))."""
    import imageio_ffmpeg

    path = tmp / f"v{time.monotonic_ns()}.mp4"
    path.write_bytes(data)
    raw = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-f", "rawvideo",
                          "-pix_fmt", "rgb24", "-"], capture_output=True, check=True).stdout
    return np.frombuffer(raw, np.uint8).reshape(-1, H, W, 3)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(1 / np.mean((a.astype(np.float64) - b) ** 2)))


def test_a_session_streams_the_python_apis_chunks(server: Server, pipe, tmp_path: Path) -> None:
    """session.created, then the init segment, then per chunk chunk.done and one binary message (its fragments,
    which decode alone after the init); a prompt.update sent after chunk 0 holds from the next chunk not yet started
    (prompt.applied names it; chunk.done's prompt follows); the fragments are far.stream's chunks encoded by
    runtime/fmp4.py, byte for byte (the chunks before the switch as without it, those after not), and decoded they
    are pipe.generate(prompt_changes=...)'s frames within 30 dB; session.done, then a normal close; the metrics."""
    from runtime import far as far_loop
    from runtime import fmp4

    chunks_before = _metric(server, "wan_aot_realtime_chunks_total")
    with connect(_url(server), additional_headers=AUTH) as ws:
        created = _event(ws)
        assert created["type"] == "session.created" and created["session"]["id"].startswith("rt_")
        assert created["session"]["shapes"] == [{"size": "64x32", "frames": FRAMES, "seconds": "1.5625"}]
        _start(ws, seed=5, steps=2, guidance_scale=3.0, frames=FRAMES)
        init = ws.recv(timeout=60)
        assert isinstance(init, bytes) and [k for k, _, _ in fmp4.boxes(init)] == ["ftyp", "moov"]
        events, fragments, applied = [], [], None
        while True:
            event = _event(ws)
            events.append(event)
            if event["type"] == "chunk.done":
                fragments.append(ws.recv(timeout=60))
                assert isinstance(fragments[-1], bytes)
                if event["chunk"] == 0:
                    ws.send(json.dumps({"type": "prompt.update", "prompt": OTHER}))
                    assert _metric(server, "wan_aot_realtime_sessions") == 1
            elif event["type"] == "prompt.applied":
                applied = event["chunk"]
            elif event["type"] == "session.done":
                break
        with pytest.raises(websockets.ConnectionClosedOK):
            ws.recv(timeout=10)
        assert ws.close_code == 1000
    done = [e for e in events if e["type"] == "chunk.done"]
    assert [e["chunk"] for e in done] == [0, 1, 2, 3] and [e["frames"] for e in done] == [1, 8, 8, 8]
    assert [e["seconds"] for e in done] == [1 / 16, 0.5, 0.5, 0.5]
    assert applied in (1, 2, 3) and {"type": "prompt.applied", "chunk": applied, "prompt": OTHER} in events
    assert [e["prompt"] for e in done] == [PROMPT] * applied + [OTHER] * (4 - applied)
    assert events[-1] == {"type": "session.done", "chunks": 4, "frames": FRAMES, "stopped": False}
    for fragment, event in zip(fragments, done, strict=True):  # each chunk's message decodes after the init
        assert [k for k, _, _ in fmp4.boxes(fragment)] == ["moof", "mdat"]
        assert _decode(init + fragment, tmp_path).shape == (event["frames"], H, W, 3)

    def python_api(switch: int | None) -> list[bytes]:
        session = far_loop.stream(pipe, PROMPT, NEGATIVE, seed=5, steps=2, guidance=3.0)
        video, out = fmp4.Fragments(16), []
        for k in range(4):
            if k == switch:
                session.prompt = OTHER
            out.append(video.add(next(session).frames))
        assert video.init == init
        return out

    assert python_api(applied) == fragments
    plain = python_api(None)
    assert plain[:applied] == fragments[:applied] and all(a != b for a, b in zip(plain[applied:], fragments[applied:]))
    decoded = _decode(init + b"".join(fragments), tmp_path)
    frames = pipe.generate(PROMPT, NEGATIVE, seed=5, steps=2, guidance=3.0, prompt_changes={applied: OTHER},
                           progress=False)[0]
    assert decoded.shape == frames.shape and _psnr(decoded / 255, frames) > 30
    assert _metric(server, "wan_aot_realtime_chunks_total") == chunks_before + 4
    assert _metric(server, "wan_aot_realtime_sessions") == 0


def test_bad_events_are_answered_and_the_session_stays_usable(server: Server) -> None:
    """Text that is not JSON, an unknown type, bad values (each naming its field), a prompt.update with no session
    and a binary message: each an `error`, the connection open; then a session starts and is stopped with
    session.stop after its first chunk. A message over --realtime-max-message-kb closes with 1009."""
    bad = [("{not json", "invalid_json", None), (json.dumps({"type": "session.begin"}), "unknown_event", "type"),
           (json.dumps([1, 2]), "invalid_event", "type"),
           (json.dumps({"type": "session.start", "session": {"prompt": PROMPT, "steps": 0}}), "invalid_value",
            "steps"),
           (json.dumps({"type": "session.start", "session": {"prompt": PROMPT, "size": "9x9"}}), "invalid_value",
            "size"),
           (json.dumps({"type": "session.start", "session": {"prompt": PROMPT, "frames": 24}}), "invalid_value",
            "frames"),
           (json.dumps({"type": "session.start", "session": {"prompt": PROMPT, "sampler": "unipc"}}),
            "invalid_value", "sampler"),
           (json.dumps({"type": "session.start", "session": {"prompt": "", "seed": 1}}), "invalid_value", "prompt"),
           (json.dumps({"type": "session.start", "session": {"prompt": PROMPT, "fps": 8}}), "invalid_value", "fps"),
           (json.dumps({"type": "prompt.update", "prompt": OTHER}), "no_session", "type"),
           (b"\x00\x01", "binary_not_accepted", None)]
    with connect(_url(server), additional_headers=AUTH) as ws:
        assert _event(ws)["type"] == "session.created"
        for message, code, param in bad:
            ws.send(message)
            error = _event(ws)
            assert error["type"] == "error" and (error["error"]["code"], error["error"]["param"]) == (code, param), \
                (message, error)
            assert error["error"]["message"]
        _start(ws, steps=1, seed=2)
        assert isinstance(ws.recv(timeout=60), bytes)  # the init segment
        assert _event(ws)["type"] == "chunk.done"
        ws.send(json.dumps({"type": "session.stop"}))
        rest = []
        with pytest.raises(websockets.ConnectionClosedOK):
            while True:
                rest.append(ws.recv(timeout=60))
        done = json.loads(rest[-1])
        assert done["type"] == "session.done" and done["stopped"] and done["chunks"] < 4
    with connect(_url(server), additional_headers=AUTH, max_size=None) as ws:
        _event(ws)
        ws.send(json.dumps({"type": "prompt.update", "prompt": "x" * 5000}))
        with pytest.raises(websockets.ConnectionClosedError):
            ws.recv(timeout=10)
        assert ws.close_code == 1009


def test_refused_before_accepting(server: Server, far: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    """401 without a key, with a wrong one (an OpenAI-shaped body), from another site's page; a browser's key as a
    subprotocol is taken (and `wan-aot.realtime` selected); a plain GET is 426; a bundle of another kind is 404, one
    still loading 503, a multi-host slice 501."""
    import dataclasses

    import httpx
    from fastapi.testclient import TestClient
    from starlette.testclient import WebSocketDenialResponse

    from runtime import kinds
    from runtime import manifest as mf
    from runtime.serve.jobs import open_store
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State
    from runtime.serve.tenants import Keys

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(websockets.InvalidStatus) as e:
            connect(_url(server), additional_headers=headers)
        assert e.value.response.status_code == 401
        assert json.loads(e.value.response.body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(websockets.InvalidStatus) as e:
        connect(_url(server), additional_headers={**AUTH, "Origin": "http://evil.example"})
    assert e.value.response.status_code == 400
    with connect(_url(server), subprotocols=["wan-aot.realtime", "wan-aot-key." + KEY.encode().hex()]) as ws:
        assert ws.subprotocol == "wan-aot.realtime" and _event(ws)["type"] == "session.created"
    r = httpx.get(server.url + "/v1/realtime/video", headers=AUTH)
    assert r.status_code == 426 and r.json()["error"]["code"] == "upgrade_required"

    offer = Offer.of(mf.read(far[1]), "other")
    state = State(settings=Settings(bundle=far[1], jobs_dir=tmp_path / "jobs", keys=Keys.load(None, "k")),
                  store=open_store(tmp_path / "jobs"), offer=dataclasses.replace(offer, kind=kinds.get("t2v")))
    state.ready.set()
    client = TestClient(create_app(state), base_url="http://127.0.0.1")
    with pytest.raises(WebSocketDenialResponse) as denied:
        client.websocket_connect("/v1/realtime/video", headers={"Authorization": "Bearer k"}).__enter__()
    assert denied.value.status_code == 404 and "AnyFlow-FAR" in denied.value.json()["error"]["message"]
    state.offer, state.broadcast = offer, lambda message: None  # the FAR bundle, on a multi-host slice
    for ready, status, code in ((False, 503, "loading"), (True, 501, "not_implemented")):
        (state.ready.set if ready else state.ready.clear)()
        with pytest.raises(WebSocketDenialResponse) as denied:
            client.websocket_connect("/v1/realtime/video", headers={"Authorization": "Bearer k"}).__enter__()
        assert (denied.value.status_code, denied.value.json()["error"]["code"]) == (status, code)
    state.store.close()


def test_the_idle_timeout_and_the_length_limit(far: tuple[Path, Path], pipe, tmp_path: Path) -> None:  # noqa: F811
    """In process (the app on the test's pipe): a connection that starts no session within --realtime-idle-timeout
    gets idle_timeout and a normal close; a session running past --realtime-max-seconds stops (session_too_long,
    then session.done, stopped) and frees the slot."""
    from fastapi.testclient import TestClient

    from runtime import manifest as mf
    from runtime.serve.jobs import open_store
    from runtime.serve.limits import Limits
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State

    limits = Limits(realtime_idle=0.5, realtime_max_seconds=0.5)
    state = State(settings=Settings(bundle=far[1], jobs_dir=tmp_path / "jobs", limits=limits),
                  store=open_store(tmp_path / "jobs"), offer=Offer.of(mf.read(far[1]), "far"))
    state.pipe = pipe
    state.ready.set()
    client = TestClient(create_app(state), base_url="http://127.0.0.1")
    try:
        with client.websocket_connect("/v1/realtime/video") as ws:
            assert ws.receive_json()["session"]["idle_timeout"] == 0.5
            t0 = time.monotonic()
            assert ws.receive_json()["error"]["code"] == "idle_timeout"
            assert 0.4 < time.monotonic() - t0 < 10
            assert ws.receive()["type"] == "websocket.close"
        with client.websocket_connect("/v1/realtime/video") as ws:
            ws.receive_json()
            ws.send_text(json.dumps({"type": "session.start", "session": {"prompt": PROMPT, "steps": SLOW_STEPS}}))
            events = []
            while not events or events[-1].get("type") != "session.done":
                message = ws.receive()
                assert message["type"] == "websocket.send"
                if message.get("text"):
                    events.append(json.loads(message["text"]))
            assert ws.receive()["type"] == "websocket.close"
        errors = [e["error"]["code"] for e in events if e["type"] == "error"]
        assert errors == ["session_too_long"] and events[-1]["stopped"] and events[-1]["chunks"] < 4, events
        assert state.slot.acquire(blocking=False)
        state.slot.release()
    finally:
        state.store.close()


class Held:
    """A served app in this process (on the test's pipe, with a key, a worker thread, uvicorn on 127.0.0.1) whose
    sessions are held before their chunk 2 until the test lets them go (`go`); `held` is set once one is; `updated`
    once a prompt.update was taken."""

    def __init__(self, far_bundle: Path, pipe, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        import uvicorn

        from runtime import far as far_loop
        from runtime import manifest as mf
        from runtime.serve import realtime
        from runtime.serve.jobs import open_store
        from runtime.serve.metrics import make_metrics
        from runtime.serve.routes import create_app
        from runtime.serve.schema import Offer
        from runtime.serve.state import Settings, State
        from runtime.serve.tenants import Keys
        from runtime.serve.worker import worker

        self.held, self.updated, self.go = threading.Event(), threading.Event(), threading.Event()
        stream, update, outer = far_loop.stream, realtime.Connection._update, self

        class Session:
            def __init__(self, session: far_loop.Session) -> None:
                self.session, self.layout, self.made = session, session.layout, 0

            @property
            def prompt(self) -> str:
                return self.session.prompt

            @prompt.setter
            def prompt(self, value: str) -> None:
                self.session.prompt = value

            def __next__(self) -> far_loop.Chunk:
                if self.made == 2:
                    outer.held.set()
                    assert outer.go.wait(120)
                self.made += 1
                return next(self.session)

        def noted(connection, event: dict) -> None:
            update(connection, event)
            outer.updated.set()

        monkeypatch.setattr(far_loop, "stream", lambda *a, **kw: Session(stream(*a, **kw)))
        monkeypatch.setattr(realtime.Connection, "_update", noted)
        self.state = state = State(settings=Settings(bundle=far_bundle, jobs_dir=tmp / "jobs", keys=Keys.load(None,
                                   KEY)), store=open_store(tmp / "jobs"), offer=Offer.of(mf.read(far_bundle), "far"))
        state.pipe, state.metrics = pipe, make_metrics(state.store)
        state.ready.set()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.threads = [threading.Thread(target=self.server.run, daemon=True),
                        threading.Thread(target=worker, args=(state,), daemon=True)]
        for thread in self.threads:
            thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)

    def metric(self, name: str) -> float | None:
        return self.state.metrics.registry.get_sample_value(name)

    def close(self) -> None:
        self.go.set()
        self.state.draining.set()
        self.state.wake.set()
        self.server.should_exit = True
        for thread in self.threads:
            thread.join(30)
        self.state.store.close()


def test_a_client_that_goes_away_frees_the_slot(far: tuple[Path, Path], pipe, tmp_path: Path,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A session holds the replica's worker slot: while it runs (held before its chunk 2), a /v1/videos job stays
    queued and a second session's start is refused (server_busy), its connection kept. The first client goes away
    (its socket cut, no close handshake): its session stops at its next denoising step, inside chunk 2, which is never
    sent; the slot is freed, the job runs, the second session starts and completes."""
    import httpx

    app = Held(far[1], pipe, tmp_path, monkeypatch)
    url = app.url.replace("http://", "ws://") + "/v1/realtime/video"
    try:
        with connect(url, additional_headers=AUTH) as first, connect(url, additional_headers=AUTH) as second:
            _event(first)
            _event(second)
            _start(first, steps=2)
            assert app.held.wait(60)
            job = httpx.post(app.url + "/v1/videos", headers=AUTH, json={"prompt": "a queued fox",
                                                                         "num_inference_steps": 1}).json()
            _start(second, steps=1)
            busy = _event(second)
            assert busy["type"] == "error" and busy["error"]["code"] == "server_busy", busy
            assert app.metric("wan_aot_realtime_sessions") == 2
            time.sleep(0.5)  # the worker had every chance to claim the job
            assert app.state.store.get(job["id"]).status == "queued"
            first.socket.shutdown(socket.SHUT_RDWR)  # gone: no close handshake
            deadline = time.time() + 30
            while app.metric("wan_aot_realtime_sessions") != 1:
                assert time.time() < deadline
                time.sleep(0.02)
            app.go.set()
            while app.state.store.get(job["id"]).status != "completed":
                assert time.time() < deadline + 30, app.state.store.get(job["id"])
                time.sleep(0.05)
            assert app.metric("wan_aot_realtime_chunks_total") == 2  # chunks 0 and 1: chunk 2 stopped inside
            _start(second, steps=1)
            kinds = []
            with pytest.raises(websockets.ConnectionClosedOK):
                while True:
                    message = second.recv(timeout=60)
                    kinds.append(json.loads(message)["type"] if isinstance(message, str) else "binary")
            assert kinds[-1] == "session.done" and kinds.count("chunk.done") == 4 and kinds.count("binary") == 5
        deadline = time.time() + 10
        while app.metric("wan_aot_realtime_sessions") != 0:
            assert time.time() < deadline
            time.sleep(0.02)
    finally:
        app.close()


def test_the_playground_plays_a_live_session(far: tuple[Path, Path], pipe, tmp_path: Path,  # noqa: F811
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The playground in chromium (headless, as tests/test_playground.py drives it) on a FAR bundle with a key: a
    blank prompt is refused by the server (its error shown, the form free again); the live form starts a session (the
    key sent as a subprotocol); the session is held before chunk 2 while the page
    plays chunks 0 and 1 through MediaSource; a new prompt typed then reaches the next chunk not yet started (3: the
    held chunk 2 had started), as the page's chunk list shows; then the session ends and the page says so."""
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise AssertionError("chromium is not installed: apt-get install chromium (.ci/run does)")
    app = Held(far[1], pipe, tmp_path, monkeypatch)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" and "401" not in m.text
                    else None)
            page.goto(app.url + "/")
            page.get_by_label("API key").fill(KEY)
            page.get_by_role("button", name="Use key").click()
            page.get_by_label("Live prompt").fill("   ")  # refused by the server: said, and the form free again
            page.get_by_role("button", name="Start").click()
            sync_api.expect(page.locator("#live-error")).to_contain_text("prompt", timeout=30_000)
            sync_api.expect(page.get_by_role("button", name="Start")).to_be_enabled()
            page.get_by_label("Live prompt").fill(PROMPT)
            page.get_by_label("Passes per chunk").fill("2")
            page.get_by_role("button", name="Start").click()
            assert app.held.wait(60)
            video = page.get_by_label("Live session video")
            page.wait_for_function("v => v.currentTime > 0 && v.readyState >= 2", arg=video.element_handle(),
                                   timeout=60_000)  # chunks 0 and 1 play while the session is held before 2
            assert video.evaluate("v => [v.videoWidth, v.videoHeight]") == [W, H]
            assert page.locator("#live-chunks li").count() == 2 and not app.go.is_set()
            page.get_by_label("Next prompt (from the next chunk)").fill(OTHER)
            page.get_by_role("button", name="Change prompt").click()
            assert app.updated.wait(30)
            app.go.set()
            sync_api.expect(page.locator("#live-status")).to_have_text("Done: 4 chunks, 25 frames", timeout=60_000)
            chunks = page.locator("#live-chunks li").all_inner_texts()
            assert len(chunks) == 4 and chunks[2].endswith(PROMPT) and chunks[3].endswith(OTHER), chunks
            page.wait_for_function("v => Math.abs(v.duration - 25 / 16) < 0.01", arg=video.element_handle(),
                                   timeout=30_000)
            assert not problems and page.locator("#live-error").inner_text() == "", problems  # cleared by Start
            browser.close()
    finally:
        app.close()
