"""`runtime serve` against a hostile client (issue 43's findings 1-10): bounded metrics, Host and Origin checks, slow
heads and bodies cut off, uploads and decodes bounded, malformed bodies answered 400, every error in the OpenAI shape,
a key with a trailing newline, the jobs directory private.

One server without a key (loopback, as a local user runs it) with small limits, so that each deadline passes in a
second or two. Clients are raw sockets where the point is what a well-behaved client would never send. Servers
listen on 127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import json
import select
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_serve import Server, _wait, serving

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, MAX_UPLOADS, MAX_CONNECTIONS = 1, 2, 1, 2, 16
LIMITS = ("--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT), "--keep-alive",
          str(KEEP_ALIVE), "--max-uploads", str(MAX_UPLOADS), "--max-connections", str(MAX_CONNECTIONS))


@pytest.fixture(scope="module")
def server(fp32_bundles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(fp32_bundles["tiny-64x32-f9"], tmp_path_factory.mktemp("hostile") / "jobs", *LIMITS) as server:
        yield server


@pytest.fixture(scope="module")
def video(server: Server) -> str:
    """A completed job's id."""
    client = server.client(key="unused")
    made = client.videos.create(prompt="a lighthouse", extra_body={"num_inference_steps": 1})
    assert _wait(client, made.id, ("completed", "failed")).status == "completed", server.output()
    return made.id


def _connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection (or `timeout` passes: then AssertionError)."""
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server kept the connection open for {timeout} s (sent {data[:200]!r})")


def _error(raw: bytes) -> tuple[int, dict]:
    """(status, the OpenAI error) of a raw HTTP response; AssertionError if it is not in that shape."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), raw[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return status, error


def _assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = "-") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if code is not None:
        assert error["code"] == code, error
    if param != "-":
        assert error["param"] == param, error
    return error


def test_metrics_labels_stay_bounded(server: Server) -> None:
    """Finding 1: made-up methods and paths add no series to /metrics (each was a new `method` label, kept for
    ever); they are counted under `other`."""

    def series() -> set[str]:
        text = httpx.get(server.url + "/metrics").text
        return {line.split(" ")[0] for line in text.splitlines() if line.startswith("wan_aot_request_seconds_count")}

    httpx.request("BREW", server.url + "/v1/videos")  # the two series all of them go under
    httpx.request("BREW", server.url + f"/nowhere-{uuid.uuid4().hex}")
    before = series()
    with httpx.Client() as client:
        for i in range(150):
            client.request(f"X{uuid.uuid4().hex[:8].upper()}", server.url + "/v1/videos")
            client.request(f"Y{i}", server.url + f"/nowhere-{uuid.uuid4().hex}")
    after = series()
    assert after - before <= {'wan_aot_request_seconds_count{method="GET",route="/metrics",status="200"}'}, \
        sorted(after - before)
    assert 'method="other",route="/v1/videos",status="405"' in " ".join(after)
    assert 'method="other",route="other",status="404"' in " ".join(after)


def test_host_and_origin_are_checked(server: Server) -> None:
    """Finding 2: without a key, a page the local user opens must not drive the server: a Host that is not the
    server's (DNS rebinding) is a 400, so is a state-changing request from another origin (a form POSTs without a
    CORS preflight); form-encoded bodies are a 415; the page's own origin and clients without Origin are served."""
    evil = {"Host": f"evil.example:{server.port}"}
    for method, path in (("GET", "/v1/videos"), ("GET", "/v1/models"), ("POST", "/v1/videos"), ("GET", "/metrics"),
                         ("GET", "/")):
        r = httpx.request(method, server.url + path, headers=evil, json={"prompt": "a"} if method == "POST" else None)
        error = _assert_error(r, 400, "invalid_host")
        assert "evil.example" in error["message"] and "--allowed-host" in error["message"]
    assert httpx.get(server.url + "/health", headers=evil).status_code == 200  # probes address pods by IP
    assert httpx.get(server.url + "/v1/models", headers={"Host": f"localhost:{server.port}"}).status_code == 200
    before = {v["id"] for v in httpx.get(server.url + "/v1/videos?limit=100").json()["data"]}
    for origin in ("http://evil.example", f"http://127.0.0.1:{server.port + 1}", "null", "https://127.0.0.1:1"):
        r = httpx.post(server.url + "/v1/videos", json={"prompt": "from a web page"}, headers={"Origin": origin})
        _assert_error(r, 400, "cross_origin_request")
        r = httpx.delete(server.url + "/v1/videos/video_x", headers={"Origin": origin})
        _assert_error(r, 400, "cross_origin_request")
    for ctype, body in (("application/x-www-form-urlencoded", b"prompt=a"), ("text/plain", b'{"prompt": "a"}')):
        r = httpx.post(server.url + "/v1/videos", content=body, headers={"Content-Type": ctype})
        _assert_error(r, 415, "unsupported_media_type")
    assert {v["id"] for v in httpx.get(server.url + "/v1/videos?limit=100").json()["data"]} == before  # none queued
    r = httpx.post(server.url + "/v1/videos", json={"prompt": "from the playground", "num_inference_steps": 1},
                   headers={"Origin": server.url})  # the page's own origin
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/v1/videos", headers={"Origin": "http://evil.example"}).status_code == 200  # GET


def test_slow_bodies_are_cut_off_and_bounded(server: Server) -> None:
    """Finding 3: a body that trickles in (a byte every 0.2 s of an announced 30 MB) is answered 408 and its
    connection closed once the body timeout passes; uploads beyond --max-uploads are refused at once (503), not
    left holding a connection and the memory they fill."""
    head = (b"POST /v1/videos HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: 30000000\r\n\r\n{" % server.port)
    socks = []
    for _ in range(MAX_UPLOADS + 1):
        sock = _connect(server)
        sock.sendall(head)
        socks.append(sock)
        time.sleep(0.1)  # in order: the last one finds every upload slot taken
    t0, answers = time.monotonic(), {}
    while len(answers) < len(socks) and time.monotonic() - t0 < BODY_TIMEOUT + 6:
        for i, sock in enumerate(socks):
            if i in answers:
                continue
            ready, _, _ = select.select([sock], [], [], 0)
            if ready:
                answers[i] = (time.monotonic() - t0, _read_until_closed(sock, 5))
            else:
                try:
                    sock.sendall(b" ")  # still uploading, slowly
                except OSError:
                    answers[i] = (time.monotonic() - t0, b"")
        time.sleep(0.2)
    for sock in socks:
        sock.close()
    assert len(answers) == len(socks), f"connections still open after {BODY_TIMEOUT + 6} s: {answers}"
    for i in range(MAX_UPLOADS):
        status, error = _error(answers[i][1])
        assert (status, error["code"]) == (408, "request_timeout") and "--body-timeout" in error["message"], error
    seconds, raw = answers[MAX_UPLOADS]
    status, error = _error(raw)
    assert (status, error["code"]) == (503, "server_busy") and b"retry-after: 1" in raw.lower(), raw
    assert seconds < BODY_TIMEOUT  # refused at once, not after the others timed out
    assert httpx.get(server.url + "/health").status_code == 200


def test_malformed_json_is_a_400_not_a_500(server: Server) -> None:
    """Finding 5: a body nested 100,000 deep, an integer of 5,001 digits, text with a lone surrogate (as a value, in a
    nested value, or as a field name) are each a 400 in the OpenAI shape naming the field, logged in one line, no
    traceback."""
    cases = [(b"[" * 100_000 + b"]" * 100_000, None, "not valid JSON"),
             (b'{"prompt": "a", "seed": ' + b"7" * 5001 + b"}", None, "not valid JSON"),
             (b'{"prompt": "\\ud800"}', "prompt", "prompt is not valid Unicode text"),
             (b'{"prompt": "a", "negative_prompt": "ok \\udfff"}', "negative_prompt", "negative_prompt is not valid"),
             (b'{"prompt": "a", "model": ["x", {"y": "\\ud83d"}]}', "model", "model is not valid Unicode text"),
             (b'{"prompt": "a", "\\ud800": 1}', None, "a field name is not valid Unicode text")]
    for body, param, message in cases:
        r = httpx.post(server.url + "/v1/videos", content=body, headers={"Content-Type": "application/json"})
        error = _assert_error(r, 400, "invalid_request", param)
        assert message in error["message"], error
    log = server.output()
    assert "Traceback" not in log and "Internal Server Error" not in log, log
    assert "answered 400 invalid_request: prompt is not valid Unicode text" in log, log


def test_every_error_is_in_the_openai_shape(server: Server, video: str) -> None:
    """Finding 6: the multipart parser's limits, Range headers /content refuses, a malformed request line and a head
    too large, all in {"error": {"message", "type", "param", "code"}} (they were Starlette's {"detail"} or text)."""
    url = server.url + "/v1/videos"
    too_many = {f"f{i}": "x" for i in range(70)}
    error = _assert_error(httpx.post(url, data=too_many, files={"input_reference": ("a.png", b"x")}), 400)
    assert "Too many fields" in error["message"]
    error = _assert_error(httpx.post(url, data={"prompt": "x" * (21 << 20)}, files={"f": ("a", b"b")}), 400)
    assert "exceeded maximum size" in error["message"]
    error = _assert_error(httpx.post(url, content=b"garbage", headers={
        "Content-Type": "multipart/form-data; boundary=zz"}), 400)
    assert "multipart" in error["message"].lower()
    content = f"{url}/{video}/content"
    size = len(httpx.get(content).content)
    for bad in ("bytes=abc", "bytes=5-1", "items=0-1", "bytes=-"):
        _assert_error(httpx.get(content, headers={"Range": bad}), 400, "invalid_request", "range")
    r = httpx.get(content, headers={"Range": f"bytes={size}-"})
    _assert_error(r, 416, "range_not_satisfiable")
    assert r.headers["content-range"] == f"bytes */{size}"
    r = httpx.get(content, headers={"Range": "bytes=0-3"})
    assert (r.status_code, len(r.content), r.headers["content-range"]) == (206, 4, f"bytes 0-3/{size}")
    with _connect(server) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        assert _error(_read_until_closed(sock, 5))[0] == 400
    with _connect(server) as sock:  # a head that goes on past 16 KB without ending
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"a" * (20 << 10))
        status, error = _error(_read_until_closed(sock, 5))
        assert (status, error["code"]) == (431, "request_header_fields_too_large"), error


def test_slow_heads_idle_and_too_many_connections(server: Server) -> None:
    """Finding 7: connections that send nothing, or a header line every 0.3 s (slowloris), are closed once the header
    timeout passes (the slow ones answered 408); a kept-alive connection idle past --keep-alive is closed; a request
    on a connection beyond --max-connections is answered 503 in the OpenAI shape."""
    idle = [_connect(server) for _ in range(4)]
    slow = [_connect(server) for _ in range(4)]
    for sock in slow:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    t0, closed = time.monotonic(), {}
    while len(closed) < 8 and time.monotonic() - t0 < HEADER_TIMEOUT + 5:
        for sock in idle + slow:
            if sock in closed:
                continue
            if select.select([sock], [], [], 0)[0]:
                closed[sock] = _read_until_closed(sock, 5)
            elif sock in slow:
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    closed[sock] = b""
        time.sleep(0.3)
    assert len(closed) == 8, f"{8 - len(closed)} connections still open after {HEADER_TIMEOUT + 5} s"
    assert all(closed[sock] == b"" for sock in idle)  # nothing asked, nothing answered
    for sock in slow:
        status, error = _error(closed[sock])
        assert (status, error["code"]) == (408, "request_timeout") and "--header-timeout" in error["message"]
    for sock in idle + slow:
        sock.close()

    with _connect(server) as sock:  # keep-alive: one request, then idle
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        t0 = time.monotonic()
        answer = _read_until_closed(sock, KEEP_ALIVE + 3)
        assert answer.startswith(b"HTTP/1.1 200") and time.monotonic() - t0 >= KEEP_ALIVE * 0.8

    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        with _connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            raw = _read_until_closed(sock, 5)
        status, error = _error(raw)
        assert (status, error["code"]) == (503, "server_busy") and "--max-connections" in error["message"], error
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)


def test_the_jobs_directory_is_private(server: Server, video: str) -> None:
    """Finding 10: the jobs directory (prompts in jobs.sqlite3, the videos) is 0700 and its files 0600, whatever the
    umask (it was 0755 and 0644 here)."""
    jobs = Path(server.proc.args[server.proc.args.index("--jobs-dir") + 1])
    for path in (jobs, jobs / "videos", jobs / "images"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    files = [p for p in jobs.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"jobs.sqlite3", "jobs.sqlite3-wal"} and any(p.suffix == ".mp4" for p in files)
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_full_queue_is_answered_before_any_media_is_decoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 4: with no room in the queue a create request is a 429 before its body is read or its media looked at
    (a 40-megapixel PNG was decoded first, then refused)."""
    from runtime.serve import schema

    from .test_tenants import app_client

    looked_at = []
    monkeypatch.setattr(schema, "check_image", lambda name, data: looked_at.append(name))
    client, state = app_client(tmp_path, kind="i2v", queue_size=1)
    state.store.add(model="m", size="64x32", seconds="1", prompt="waiting", params={}, images=[], queue_size=1)
    r = client.post("/v1/videos", data={"prompt": "a"}, files={"input_reference": ("big.png", b"\x89PNG" + b"0" * 99)})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    assert looked_at == []


def test_media_is_decoded_a_few_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 4: at most --max-decodes requests decode their media at once (each decode can take far more memory
    than its upload); the others wait their turn, and all are queued."""
    import threading

    from runtime.serve import routes, schema
    from runtime.serve.limits import Limits

    from .test_tenants import app_client

    _, state = app_client(tmp_path, kind="i2v", limits=Limits(max_decodes=2))
    now, most, lock = [0], [0], threading.Lock()

    def decode(name: str, data: bytes) -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.2)
        with lock:
            now[0] -= 1

    monkeypatch.setattr(schema, "check_image", decode)
    body = schema.Body(fields={"prompt": "a"}, files={"input_reference": [b"an image"]}, form=True)
    threads = [threading.Thread(target=routes._create, args=(state, body, "default")) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert most[0] == 2 and state.store.counts()["queued"] == 6
