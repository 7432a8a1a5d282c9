"""Webhooks, driven with the openai SDK (`client.webhooks`): endpoints per tenant, deliveries of video.completed and
video.failed to loopback receivers that verify them with `client.webhooks.unwrap`, each delivered once, a tenant's
events never another's, the server's own endpoint (--webhook-url) getting every one, a receiver that is down until
after a server restart still getting its event (same webhook-id), and the addresses refused.

Servers and receivers listen on 127.0.0.1 only (allowed with --webhook-allow 127.0.0.1); every wait is bounded.
"""

from __future__ import annotations

import base64
import http.server
import json
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_serve import Server, _free_port, _wait, serving

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

ALICE, BOB = "sk-alice-" + "a" * 24, "sk-bob-" + "b" * 24
SERVER_SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
TWO_STEPS = {"num_inference_steps": 2}


class Receiver:
    """An HTTP server on a loopback port that records every POST (path, headers, body) and answers `status`."""

    def __init__(self, port: int | None = None, status: int = 200) -> None:
        self.got: list[tuple[str, dict[str, str], bytes]] = []
        self.status = status
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.got.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", port or 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def at(self, path: str) -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for p, h, b in self.got if p == path]

    def wait(self, path: str, count: int, timeout: float = 60) -> list[tuple[dict[str, str], bytes]]:
        deadline = time.time() + timeout
        while len(self.at(path)) < count and time.time() < deadline:
            time.sleep(0.05)
        assert len(self.at(path)) >= count, (path, count, self.got)
        return self.at(path)

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _events(client: openai.OpenAI, received: list[tuple[dict[str, str], bytes]], secret: str) -> list[dict]:
    """Each delivery verified (signature and timestamp) and parsed by the SDK, as a receiver does it."""
    out = []
    for headers, body in received:
        event = client.webhooks.unwrap(body, headers, secret=secret)  # raises if the signature does not match
        assert event is not None and headers["webhook-id"].startswith("msg_")
        out.append(json.loads(body))
    return out


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def hooked(shapes_bundle: Path, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two tenants, loopback allowed, and the server's own endpoint (every tenant's events) at /server. The last test
    kills it and starts it again (`again`)."""
    root = tmp_path_factory.mktemp("webhooks")
    keys = root / "keys"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    args = (shapes_bundle, root / "jobs", "--api-keys", str(keys), "--webhook-allow", "127.0.0.1", "--webhook-url",
            receiver.url("/server"), "--webhook-secret", SERVER_SECRET)
    with serving(*args) as server:
        server.again = lambda: serving(*args)  # type: ignore[attr-defined]
        yield server


def _pending(server: Server) -> float:
    import httpx

    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("wan_aot_webhook_pending "):
            return float(line.split()[1])
    raise AssertionError("no wan_aot_webhook_pending")


def test_deliveries_are_signed_per_tenant_and_each_delivered_once(hooked: Server, receiver: Receiver) -> None:
    """Alice's endpoint gets her completed and her failed (cancelled) job, Bob's (completed only) his completed job,
    the server's every one: OpenAI's event shape, verified by `unwrap` with the endpoint's secret, each once (nothing
    waits any more, and nothing more came); neither tenant sees the other's endpoints."""
    alice, bob = hooked.client(key=ALICE), hooked.client(key=BOB)
    mine = alice.webhooks.create(name="alice's", url=receiver.url("/alice"),
                                 event_types=["video.completed", "video.failed"])
    theirs = bob.webhooks.create(name="bob's", url=receiver.url("/bob"), event_types=["video.completed"])
    assert mine.signing_secret.startswith("whsec_") and mine.signing_secret_hint.endswith(mine.signing_secret[-4:])
    assert [e.id for e in alice.webhooks.list()] == [mine.id] and [e.id for e in bob.webhooks.list()] == [theirs.id]
    for call in (lambda: alice.webhooks.retrieve(theirs.id), lambda: alice.webhooks.delete(theirs.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    done = alice.videos.create(prompt="a kite", extra_body=TWO_STEPS)
    failed = alice.videos.create(prompt="never made", extra_body=TWO_STEPS)
    alice.post(f"/videos/{failed.id}/cancel", cast_to=openai.types.Video)
    bobs = bob.videos.create(prompt="a boat", extra_body=TWO_STEPS)
    for client, video in ((alice, done), (bob, bobs)):
        assert _wait(client, video.id, ("completed", "failed")).status == "completed"
    got = {"/alice": receiver.wait("/alice", 2), "/bob": receiver.wait("/bob", 1),
           "/server": receiver.wait("/server", 3)}
    deadline = time.time() + 30
    while _pending(hooked) and time.time() < deadline:
        time.sleep(0.05)
    assert _pending(hooked) == 0
    for call in (lambda: bob.videos.remix(done.id, prompt="mine now"),  # another tenant's video is not there
                 lambda: bob.videos.edit(prompt="mine now", video=openai.omit, extra_body={"video": {"id": done.id}})):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "not_found"
    events = {path: _events(alice, receiver.at(path), secret) for path, secret in (
        ("/alice", mine.signing_secret), ("/bob", theirs.signing_secret), ("/server", SERVER_SECRET))}
    assert {(e["type"], e["data"]["id"]) for e in events["/alice"]} == {("video.completed", done.id),
                                                                          ("video.failed", failed.id)}
    assert [(e["type"], e["data"]["id"]) for e in events["/bob"]] == [("video.completed", bobs.id)]
    assert len(events["/server"]) == 3 and {e["data"]["id"] for e in events["/server"]} == {done.id, failed.id, bobs.id}
    for e in (e for es in events.values() for e in es):
        assert set(e) == {"id", "object", "type", "created_at", "data"} and e["object"] == "event"
        assert e["id"].startswith("evt_") and isinstance(e["created_at"], int) and set(e["data"]) == {"id"}
    assert {len(got[p]) for p in got} == {len(receiver.at(p)) for p in got}  # once each: nothing came since
    with pytest.raises(openai.InvalidWebhookSignatureError):  # another endpoint's secret does not verify
        alice.webhooks.unwrap(receiver.at("/alice")[0][1], receiver.at("/alice")[0][0], secret=theirs.signing_secret)
    # a rotation that keeps the old secret for a while: the test delivery carries both signatures
    rotated = alice.webhooks.rotate_secret(mine.id, keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret != mine.signing_secret
    result = alice.webhooks.test(mine.id, event_type="video.completed")
    assert (result.status_code, result.success, result.webhook_endpoint_id) == (200, True, mine.id)
    headers, body = receiver.at("/alice")[-1]
    for secret in (rotated.signing_secret, mine.signing_secret):
        assert alice.webhooks.unwrap(body, headers, secret=secret).type == "video.completed"
    assert alice.webhooks.delete(mine.id).deleted and not alice.webhooks.list().data


def test_private_addresses_are_refused(hooked: Server) -> None:
    """An endpoint's URL must be http(s) to a public host: a private, loopback or link-local address (or a name that
    is one) is a 400 naming `url` unless --webhook-allow names it; the same at the command line."""
    from .conftest import run_cli

    client = hooked.client(key=ALICE)
    for url in ("http://10.0.0.1/hook", "http://169.254.169.254/latest/meta-data", "http://localhost:8080/",
                "http://[::1]/", "http://192.168.1.20:8000/x", "ftp://example.com/", "http://user:pw@example.com/"):
        with pytest.raises(openai.BadRequestError) as e:
            client.webhooks.create(name="x", url=url, event_types=["video.completed"])
        assert e.value.body["param"] == "url", e.value.body
    made = client.webhooks.create(name="later", url="https://hooks.example.com/wan", event_types=["video.failed"])
    with pytest.raises(openai.BadRequestError):
        client.webhooks.update(made.id, url="http://10.1.2.3/")
    assert client.webhooks.update(made.id, name="renamed").name == "renamed"
    client.webhooks.delete(made.id)
    for args, message in (
            (["--webhook-url", "http://127.0.0.1:9/x", "--webhook-secret", SERVER_SECRET],
             "error: --webhook-url: url 'http://127.0.0.1:9/x' must be http:// or https:// with a host name"),
            (["--webhook-url", "https://hooks.example.com/x", "--webhook-secret", "whsec_short"],
             "error: --webhook-secret must be whsec_ and the base64 of 24 to 64 random bytes"),
            (["--webhook-url", "https://hooks.example.com/x"], "error: --webhook-url needs --webhook-secret")):
        proc = run_cli("runtime", "serve", "nowhere", *args, check=False)
        assert proc.returncode == 2 and proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


def test_names_are_checked_where_they_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host name that resolves to a private address is refused like the address, unless allowed by its name or by
    a network holding its address; one that does not resolve yet may be an endpoint (each delivery resolves it)."""
    import socket

    from runtime.serve import webhooks

    table = {"intranet.example.com": "10.20.30.40", "public.example.com": "93.184.215.14"}

    def fake(host: str, port: int, *args: object, **kwargs: object) -> list:
        if host not in table:
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], port))]

    monkeypatch.setattr(webhooks.socket, "getaddrinfo", fake)
    nothing = webhooks.Allow.parse([])
    with pytest.raises(webhooks.Refused, match="10.20.30.40, a private, loopback or link-local address"):
        webhooks.resolve("https://intranet.example.com/hook", nothing)
    for allow in (["intranet.example.com"], ["10.0.0.0/8"], ["other.example.com,10.20.30.40"]):
        assert webhooks.resolve("https://intranet.example.com/hook", webhooks.Allow.parse(allow))[3]
    assert webhooks.resolve("https://public.example.com/", nothing)[3]
    assert webhooks.resolve("https://new.example.com/", nothing, unresolved_ok=True)[3] == []
    with pytest.raises(webhooks.Refused, match="does not resolve"):
        webhooks.resolve("https://new.example.com/", nothing)


def test_a_receiver_down_until_after_a_restart_gets_the_event(hooked: Server) -> None:
    """The delivery waits in the job database: the receiver is down while the job completes (the attempt fails), the
    server is killed, the receiver comes up, the server starts again and sends it, with the webhook-id it had."""
    port = _free_port()
    client = hooked.client(key=BOB)
    endpoint = client.webhooks.create(name="down", url=f"http://127.0.0.1:{port}/hook", event_types=["video.completed"])
    video = client.videos.create(prompt="a kite", extra_body=TWO_STEPS)
    assert _wait(client, video.id, ("completed", "failed")).status == "completed"
    deadline = time.time() + 60
    row = None
    while time.time() < deadline:  # its first attempt has failed: nothing listens on the port
        with sqlite3.connect(hooked.jobs / "jobs.sqlite3") as db:
            row = db.execute("SELECT id, attempts, state FROM wan_aot_webhook_deliveries WHERE endpoint = ?",
                             (endpoint.id,)).fetchone()
        if row is not None and row[1] >= 1:
            break
        time.sleep(0.05)
    assert row is not None and row[1] >= 1 and row[2] == "pending", row
    hooked.stop(signal.SIGKILL)
    receiver = Receiver(port)
    try:
        with hooked.again():  # type: ignore[attr-defined]
            (headers, body), = receiver.wait("/hook", 1)
            assert headers["webhook-id"] == row[0]  # the same message, retried
            event = client.webhooks.unwrap(body, headers, secret=endpoint.signing_secret)
            assert (event.type, json.loads(body)["data"]["id"]) == ("video.completed", video.id)
    finally:
        receiver.stop()


def _in_process(tmp_path: Path):
    """The HTTP app in this process (test_tenants.app_client: a stand-in pipeline, no worker), loopback allowed."""
    from runtime.serve import webhooks

    from .test_tenants import app_client

    client, _ = app_client(tmp_path, webhooks=webhooks.Config(allow=webhooks.Allow.parse(["127.0.0.1"])))
    return client


def _test_call(client, url: str) -> dict:
    """An endpoint at `url` made, then POST .../test: its answer."""
    made = client.post("/v1/webhook_endpoints", json={"name": "t", "url": url, "event_types": ["video.completed"]})
    assert made.status_code == 200, made.text
    answer = client.post(f"/v1/webhook_endpoints/{made.json()['id']}/test", json={"event_type": "video.completed"})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_success_means_the_endpoint_answered_2xx(tmp_path: Path, receiver: Receiver) -> None:
    """POST .../test says success only where the endpoint answered 2xx: a 500 is an answer (its status, no error)
    but no success; and the document says what success means."""
    client = _in_process(tmp_path)
    failing = Receiver(status=500)
    try:
        assert _test_call(client, failing.url("/fails")) | {"webhook_endpoint_id": ""} == {
            "object": "webhook_endpoint.test", "event_type": "video.completed", "status_code": 500,
            "success": False, "webhook_endpoint_id": "", "error": None}
        assert len(failing.at("/fails")) == 1
    finally:
        failing.stop()
    ok = _test_call(client, receiver.url("/ok"))
    assert (ok["status_code"], ok["success"], ok["error"]) == (200, True, None)
    success = client.get("/openapi.json").json()["components"]["schemas"]["WebhookEndpointTestResult"]["properties"][
        "success"]
    assert success["type"] == "boolean" and "const" not in success and "2xx" in success["description"]


def test_a_resolver_that_hangs_is_cut_at_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """getaddrinfo has no timeout: a resolver slow to say no would hold POST .../test (and a delivery's sender) for as
    long as it takes. The lookup is given up after RESOLVE_TIMEOUT (a few seconds), the endpoint reported
    unreachable, success false; a delivery is refused in the same bound, and its connection is opened within
    CONNECT_TIMEOUT."""
    import socket

    from runtime.serve import webhooks

    assert 1 <= webhooks.RESOLVE_TIMEOUT <= 5 and 1 <= webhooks.CONNECT_TIMEOUT <= 5
    asked: list[float] = []

    def unanswered(address: tuple[str, int], timeout: float) -> socket.socket:
        asked.append(timeout)
        raise TimeoutError("timed out")

    with monkeypatch.context() as patch:  # an address that never answers the connection
        patch.setattr(webhooks.socket, "create_connection", unanswered)
        with pytest.raises(TimeoutError):
            webhooks.post("http://127.0.0.1:9/hook", b"{}", {}, webhooks.Allow.parse(["127.0.0.1"]))
    assert asked == [webhooks.CONNECT_TIMEOUT]
    client = _in_process(tmp_path)
    release = threading.Event()

    def unknown(*args: object, **kwargs: object) -> list:
        raise socket.gaierror(-2, "Name or service not known")

    def hang(*args: object, **kwargs: object) -> list:
        release.wait(60)  # (released at the end: the lookup's thread ends)
        return unknown()

    monkeypatch.setattr(webhooks.socket, "getaddrinfo", unknown)  # made while its name is not known yet: allowed
    made = client.post("/v1/webhook_endpoints", json={"name": "slow", "url": "https://slow.example.com/hook",
                                                      "event_types": ["video.completed"]}).json()
    monkeypatch.setattr(webhooks.socket, "getaddrinfo", hang)
    try:
        t0 = time.monotonic()
        answer = client.post(f"/v1/webhook_endpoints/{made['id']}/test", json={"event_type": "video.completed"})
        took = time.monotonic() - t0
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert (result["status_code"], result["success"]) == (0, False), result
        assert result["error"].startswith("the endpoint could not be reached: Refused: url's host 'slow.example.com' "
                                          f"does not resolve (no answer from the resolver within "
                                          f"{webhooks.RESOLVE_TIMEOUT:g} s)"), result
        assert webhooks.RESOLVE_TIMEOUT <= took < webhooks.RESOLVE_TIMEOUT + 2, took
        monkeypatch.setattr(webhooks, "RESOLVE_TIMEOUT", 0.2)  # a delivery's attempt: the same lookup, cut
        t0 = time.monotonic()
        with pytest.raises(webhooks.Refused, match="within 0.2 s"):
            webhooks.post("https://slow.example.com/hook", b"{}", {}, webhooks.Allow.parse([]))
        assert time.monotonic() - t0 < 2
    finally:
        release.set()
