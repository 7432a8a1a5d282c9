"""GET /v1/realtime/video: a realtime session over a WebSocket on an AnyFlow-FAR bundle (runtime/far.py): the video
streamed chunk by chunk as it is made, as fragmented MP4 a browser's MediaSource plays (runtime/fmp4.py), with a
prompt that may change while it plays (LongLive's KV re-cache: far.Session).

The upgrade is checked as any request is (access.py: the Host, the Origin, the API key to a tenant) and refused
before it is accepted, with an HTTP answer in the OpenAI shape: 401 without a valid key, 404 on a bundle of another
kind, 503 while loading or draining. A browser cannot set an Authorization header on a WebSocket: it sends the key as
a subprotocol, `wan-aot-key.` and the key in hex, beside `wan-aot.realtime` (which the server selects; the key's is
never echoed).

The protocol (JSON text messages, each with a `type`; the video as binary messages):

    server -> client  session.created  {session: {id, model, fps, shapes, defaults, idle_timeout, max_session_seconds}}
                      chunk.done       {chunk, frames, prompt, seconds, elapsed}, then ONE binary message: that
                                       chunk's fMP4 fragment(s) (moof + mdat); the session's first binary message,
                                       just before chunk 0's chunk.done, is the init segment (ftyp + moov)
                      prompt.applied   {chunk, prompt}: the chunk from which a prompt.update holds
                      session.done     {chunks, frames, stopped}, then a normal close (1000)
                      error            {error: {code, message, param}}
    client -> server  session.start    {session: {prompt, negative_prompt, seed, steps, guidance_scale, sampler,
                                       frames or seconds, size}}: checked as POST /v1/videos checks its fields
                      prompt.update    {prompt}: from the next chunk not yet started
                      session.stop     stop at the next denoising step; session.done follows

A bad event (text that is not JSON, an unknown `type`, a bad value, a binary message) is answered with an `error`
naming the fault (`param`: the bad field) and the connection stays usable; a message over --realtime-max-message-kb
closes it with 1009 (the WebSocket layer). One session per connection: it ends with session.done and a close.

A session runs on the replica's devices, so it holds the replica's one worker slot (State.slot, which the worker
holds while it runs a job): it never runs beside a /v1/videos job, and a session.start while a job or another
session runs is refused (`server_busy`, the connection kept). A client that goes away stops its session at the next
denoising step (within one chunk), which frees the slot. A connection that starts no session within
--realtime-idle-timeout is closed; a session running longer than --realtime-max-seconds stops (`session_too_long`).
Metrics: wan_aot_realtime_sessions (connections open) and wan_aot_realtime_chunks_total (chunks sent).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from typing import Any

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from .. import far, fmp4
from ..errors import UserError
from . import access
from .body import Body
from .errors import ApiError
from .fields import seconds_of
from .schema import parse_request
from .state import State

log = logging.getLogger("runtime")
PATH = "/v1/realtime/video"
SUBPROTOCOL = "wan-aot.realtime"
KEY_PROTOCOL = "wan-aot-key."  # + the API key in hex: how a browser sends it (it cannot set Authorization)
# session.start's fields and the create request's names for them (checked by the same table: schema.parse_request)
START_FIELDS = {"prompt": "prompt", "negative_prompt": "negative_prompt", "seed": "seed",
                "steps": "num_inference_steps", "guidance_scale": "guidance_scale", "sampler": "sampler",
                "seconds": "seconds", "size": "size"}
SLOT_WAIT_S = 1.0  # how long session.start waits for the worker slot (the worker holds it a moment for each claim)


class EventError(Exception):
    """An `error` event: {code, message, param}."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def event(self) -> dict[str, Any]:
        return {"type": "error", "error": {"code": self.code, "message": self.message, "param": self.param}}


class _Stopped(Exception):
    """The session was stopped (session.stop, the client gone, the length limit) at a denoising step."""


class Meters:
    """The realtime metrics, on the server's registry (none where the server keeps no metrics)."""

    def __init__(self, registry: Any) -> None:
        self.sessions = self.chunks = None
        if registry is not None:
            from prometheus_client import Counter, Gauge

            self.sessions = Gauge("wan_aot_realtime_sessions", "realtime sessions open (WebSocket connections on "
                                  "/v1/realtime/video)", registry=registry)
            self.chunks = Counter("wan_aot_realtime_chunks", "chunks realtime sessions made and sent",
                                  registry=registry)


def _not_denial(record: logging.LogRecord) -> bool:
    """uvicorn (0.54, its websockets-sansio protocol) logs an error after every upgrade refused with an HTTP answer
    (its denial path never marks the handshake done): not an error here, where refusing is the point."""
    return record.getMessage() != "ASGI callable returned without completing handshake."


def add_routes(app: FastAPI, state: State) -> None:
    """The WebSocket route (on every bundle: another kind's answers 404), and a plain GET's 426."""
    if _not_denial not in logging.getLogger("uvicorn.error").filters:
        logging.getLogger("uvicorn.error").addFilter(_not_denial)
    meters = Meters(state.metrics.registry if state.metrics is not None and state.offer.kind.far else None)

    @app.websocket(PATH)
    async def realtime(ws: WebSocket) -> None:
        try:
            tenant, subprotocol = admit(state, ws.headers)
        except ApiError as e:
            if e.status not in (401, 404):
                log.info("realtime: refused %d %s: %s", e.status, e.code, e.message)
            await ws.send_denial_response(JSONResponse(e.body(), status_code=e.status, headers=e.headers))
            return
        await ws.accept(subprotocol)
        if meters.sessions is not None:
            meters.sessions.inc()
        try:
            await Connection(state, ws, tenant, meters).serve()
        finally:
            if meters.sessions is not None:
                meters.sessions.dec()

    @app.get(PATH, include_in_schema=False)
    def not_upgraded() -> None:
        raise ApiError(426, f"GET {PATH} is a WebSocket: connect with a WebSocket client (Upgrade: websocket)",
                       code="upgrade_required", headers={"Upgrade": "websocket"})


def admit(state: State, headers: Any) -> tuple[str, str | None]:
    """(the tenant, the subprotocol to select) of an upgrade, or the ApiError it is refused with: the Host and Origin
    checks (a WebSocket is not bound by CORS, so a page of another site is refused here as a POST would be), the key
    (header or subprotocol), the bundle's kind, the server's state."""
    names = state.settings.names
    access.check_host(PATH, headers, names)
    access.check_origin("POST", headers, names)  # the upgrade starts a session, which changes state
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    auth = {"authorization": headers.get("authorization", "")}
    for p in offered:
        if p.startswith(KEY_PROTOCOL) and not auth["authorization"]:
            try:
                auth["authorization"] = "Bearer " + bytes.fromhex(p[len(KEY_PROTOCOL):]).decode("ascii")
            except (ValueError, UnicodeDecodeError):
                raise ApiError(401, f"subprotocol {KEY_PROTOCOL}...: the key must be in hex") from None
    tenant = access.authorize(PATH, auth, state.settings.keys)
    kind = state.offer.kind
    if not kind.far:
        raise ApiError(404, f"this bundle is {kind.title}: realtime sessions are for AnyFlow-FAR bundles (kind "
                            "anyflow-far); make a whole video with POST /v1/videos")
    if state.draining.is_set():
        raise ApiError(503, "the server is shutting down and starts no sessions; retry on another instance",
                       code="draining")
    if not state.ready.is_set():
        raise ApiError(503, "the model is still loading; retry when GET /ready answers 200", code="loading",
                       headers={"Retry-After": "5"})
    if state.broadcast is not None:
        raise ApiError(501, "realtime sessions run on one-process replicas; this one is a multi-host slice",
                       code="not_implemented")
    return tenant, SUBPROTOCOL if SUBPROTOCOL in offered else None


class Connection:
    """One WebSocket: its events read on the event loop, its session run on a thread of its own, and every message
    out sent by one task, in order (a chunk's chunk.done and its binary message are one item, never split)."""

    def __init__(self, state: State, ws: WebSocket, tenant: str, meters: Meters) -> None:
        self.state, self.ws, self.tenant, self.meters = state, ws, tenant, meters
        self.limits = state.settings.limits
        self.id = "rt_" + secrets.token_hex(12)
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.pending: str | None = None  # a prompt.update not yet applied
        self.started = False  # a session ran (or runs) on this connection
        self.running = False
        self.closing = False

    # -- the messages out ---------------------------------------------------------------------------------------
    def emit(self, *item: Any) -> None:
        """Queue a message to send, from the event loop or the session's thread."""
        if self._on_loop():
            self.out.put_nowait(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the server's loop is gone (it stopped): nobody is listening
            pass

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def close(self, reason: str) -> None:
        self.closing = True
        self.emit("close", 1000, reason)

    async def _send(self) -> None:
        while True:
            item = await self.out.get()
            try:
                if item[0] == "close":
                    await self.ws.close(item[1], item[2])
                    return
                if item[0] == "json":
                    await self.ws.send_text(json.dumps(item[1], separators=(",", ":")))
                elif item[0] == "bytes":
                    await self.ws.send_bytes(item[1])
                else:  # "chunk": its event, then its fragments
                    await self.ws.send_text(json.dumps(item[1], separators=(",", ":")))
                    await self.ws.send_bytes(item[2])
            except Exception:  # noqa: BLE001  (the client went away mid-send: the connection ends)
                return

    # -- the connection -----------------------------------------------------------------------------------------
    async def serve(self) -> None:
        offer = self.state.offer
        self.emit("json", {"type": "session.created", "session": {
            "id": self.id, "model": self.state.model, "fps": offer.defaults.fps,
            "shapes": [{"size": s, "frames": n, "seconds": seconds_of(n, offer.defaults.fps)} for s, n in offer.shapes],
            "defaults": {"steps": offer.steps, "guidance_scale": offer.defaults.guidance,
                         "sampler": offer.defaults.sampler},
            "idle_timeout": self.limits.realtime_idle, "max_session_seconds": self.limits.realtime_max_seconds}})
        receiver = asyncio.create_task(self._receive())
        sender = asyncio.create_task(self._send())
        try:
            await asyncio.wait({receiver, sender}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stop.set()  # the client went, or the connection was closed: a running session stops
            for task in (receiver, sender):
                task.cancel()
            results = await asyncio.gather(receiver, sender, return_exceptions=True)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:  # a bug: the traceback in the log, and the connection closed as failing (1011)
            log.error("realtime %s: internal error", self.id, exc_info=failed[0])
            try:
                await self.ws.close(1011, "internal error")
            except Exception:  # noqa: BLE001  (closed already)
                pass

    async def _receive(self) -> None:
        while True:
            timeout = None if self.started or self.closing else self.limits.realtime_idle
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout)
            except TimeoutError:
                self.emit("json", EventError("idle_timeout", f"no session.start within "
                                             f"{self.limits.realtime_idle:g} s (--realtime-idle-timeout): "
                                             "closing").event())
                self.close("idle")
                continue
            if message["type"] == "websocket.disconnect":
                if self.running:
                    log.info("realtime %s: the client went away (%s); stopping the session", self.id,
                             message.get("code"))
                return
            if self.closing:
                continue
            try:
                if message.get("bytes") is not None:
                    raise EventError("binary_not_accepted", "the client sends JSON text events only (session.start, "
                                                            "prompt.update, session.stop), not binary messages")
                await self._event(message.get("text") or "")
            except EventError as e:
                self.emit("json", e.event())

    async def _event(self, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError as e:
            raise EventError("invalid_json", f"not JSON: {e}") from None
        if not isinstance(event, dict):
            raise EventError("invalid_event", "an event is a JSON object with a `type`", "type")
        kind = event.get("type")
        if kind == "session.start":
            await self._start(event)
        elif kind == "prompt.update":
            self._update(event)
        elif kind == "session.stop":
            if self.running:
                self.stop.set()
            elif not self.started:
                self.emit("json", {"type": "session.done", "chunks": 0, "frames": 0, "stopped": True})
                self.close("stopped")
        else:
            shown = json.dumps(kind)[:100]
            raise EventError("unknown_event", f"unknown event type {shown}: send session.start, prompt.update or "
                                              "session.stop", "type")

    def _update(self, event: dict[str, Any]) -> None:
        unknown = sorted(set(event) - {"type", "prompt"})
        if unknown:
            raise EventError("invalid_value", f"prompt.update takes `prompt` only, not {unknown[0]!r}", unknown[0])
        prompt = event.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise EventError("invalid_value", "prompt must be a non-empty string", "prompt")
        try:
            self.state.pipe.prompts(prompt, "prompt")
        except UserError as e:
            raise EventError("invalid_value", str(e), "prompt") from None
        if not self.running:
            raise EventError("no_session", "no session is running: send session.start first" if not self.started
                             else "the session has ended", "type")
        with self.lock:
            self.pending = prompt

    async def _start(self, event: dict[str, Any]) -> None:
        if self.started:
            raise EventError("session_running", "this connection's session has started already: one session per "
                                                "connection", "type")
        params = await run_in_threadpool(self._params, event)
        if self.state.draining.is_set():
            raise EventError("draining", "the server is shutting down and starts no sessions")
        if not await run_in_threadpool(self.state.slot.acquire, True, SLOT_WAIT_S):
            raise EventError("server_busy", "this replica's devices are busy (a /v1/videos job or another session "
                                            "runs on them): retry in a moment, or on another replica")
        self.started = self.running = True
        threading.Thread(target=self._run, args=(params,), name=f"realtime-{self.id}", daemon=True).start()

    def _params(self, event: dict[str, Any]) -> dict[str, Any]:
        """session.start's settings, checked as POST /v1/videos checks its fields (schema.parse_request), errors
        naming the session's field."""
        unknown = sorted(set(event) - {"type", "session"})
        if unknown:
            raise EventError("invalid_value", f"session.start takes `session` only, not {unknown[0]!r}", unknown[0])
        session = event.get("session")
        if not isinstance(session, dict):
            raise EventError("invalid_value", "session.start needs `session`: an object of the session's settings "
                                              "(prompt, ...)", "session")
        fields: dict[str, Any] = {}
        for name, value in session.items():
            if name == "frames":
                continue
            if name not in START_FIELDS:
                raise EventError("invalid_value", f"unknown session field {name!r}: the fields are "
                                                  f"{', '.join([*START_FIELDS, 'frames'])}", name)
            fields[START_FIELDS[name]] = value
        offer = self.state.offer
        if "frames" in session:
            frames = session["frames"]
            if "seconds" in session:
                raise EventError("invalid_value", "give frames or seconds, not both", "frames")
            size = session.get("size", offer.sizes[0])
            counts = sorted({n for s, n in offer.shapes if s == size})
            if isinstance(frames, bool) or not isinstance(frames, int) or frames not in counts:
                raise EventError("invalid_value", f"frames {json.dumps(frames)[:40]} is not a frame count this bundle "
                                                  f"makes at {size}: {', '.join(map(str, counts)) or 'none'}", "frames")
            fields["seconds"] = seconds_of(frames, offer.defaults.fps)
        names = {api: ours for ours, api in START_FIELDS.items()}
        try:
            return parse_request(Body(fields, {}, False), offer, self.state.pipe, None)
        except ApiError as e:
            param = names.get(e.param or "", e.param)
            raise EventError("invalid_value", e.message.replace("num_inference_steps", "steps"), param) from None

    # -- the session (its own thread) ---------------------------------------------------------------------------
    def _run(self, params: dict[str, Any]) -> None:
        """Make the session's chunks in order, each sent as it is made; the slot released however it ends."""
        pipe, t0 = self.state.pipe, time.monotonic()
        made = frames = 0
        stopped = False
        limit = self.limits.realtime_max_seconds
        too_long = [False]
        log.info("realtime %s: session started (tenant %s, %s, %s frames, %s steps)", self.id, self.tenant,
                 params["size"], params["frames"], params["steps"] or pipe.manifest.defaults.steps)

        def step(done: int, total: int) -> None:
            if time.monotonic() - t0 > limit:
                too_long[0] = True
                raise _Stopped
            if self.stop.is_set():
                raise _Stopped

        try:
            from .loras import set_key

            pipe.use_loras(list(pipe.base_loras))  # the server's own adapters, whatever set the last job had
            self.state.lora_key = set_key(None)
            s = pipe.settings(params["seed"], params["steps"], params["guidance"], params["flow_shift"], None,
                              params.get("sampler"), params.get("sigmas"))
            session = far.stream(pipe, params["prompt"], params["negative_prompt"], seed=s.seed, steps=s.steps,
                                 guidance=s.guidance, flow_shift=s.flow_shift, sampler=s.sampler,
                                 size=params["size"], frames=params["frames"], on_step=step)
            video = fmp4.Fragments(params["fps"])
            for k in range(session.layout.chunks):
                if self.stop.is_set():
                    raise _Stopped
                self._apply_prompt(session, k)
                started = time.monotonic()
                chunk = next(session)
                pixels = chunk.frames[0]
                data = video.add(pixels)
                if k == 0:
                    self.emit("bytes", video.init)
                made, frames = made + 1, frames + len(pixels)
                self.emit("chunk", {"type": "chunk.done", "chunk": k, "frames": len(pixels), "prompt": chunk.prompt,
                                    "seconds": float(seconds_of(len(pixels), params["fps"])),
                                    "elapsed": round(time.monotonic() - started, 3)}, data)
                if self.meters.chunks is not None:
                    self.meters.chunks.inc()
            with self.lock:
                late, self.pending = self.pending, None
            if late is not None:
                self.emit("json", EventError("too_late", "the prompt.update came after the last chunk started: no "
                                                         "chunk was left to apply it to", "prompt").event())
        except _Stopped:
            stopped = True
            if too_long[0]:
                self.emit("json", EventError("session_too_long", f"the session ran past {limit:g} s "
                                                                 "(--realtime-max-seconds): stopped").event())
        except UserError as e:
            stopped = True
            log.warning("realtime %s: failed: %s", self.id, e)
            self.emit("json", EventError("generation_failed", str(e)).event())
        except Exception as e:  # noqa: BLE001  (the session fails, the server lives on)
            stopped = True
            log.exception("realtime %s: internal error", self.id)
            self.emit("json", EventError("internal_error", f"{type(e).__name__}: {e}").event())
        finally:
            self.running = False
            self.state.slot.release()
        log.info("realtime %s: %s after %d chunks (%d frames) in %.1f s", self.id,
                 "stopped" if stopped else "done", made, frames, time.monotonic() - t0)
        self.emit("json", {"type": "session.done", "chunks": made, "frames": frames, "stopped": stopped})
        self.emit("close", 1000, "done")

    def _apply_prompt(self, session: far.Session, k: int) -> None:
        """A prompt.update received since the last chunk started: in force from chunk k (its cache re-encoded)."""
        with self.lock:
            prompt, self.pending = self.pending, None
        if prompt is not None and prompt != session.prompt:
            session.prompt = prompt
        if prompt is not None:
            self.emit("json", {"type": "prompt.applied", "chunk": k, "prompt": prompt})
