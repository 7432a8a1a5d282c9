"""uvicorn's HTTP protocol with the limits it lacks: deadlines on a request's head and body; and the answers written
at the protocol level (a malformed request, a head too large, too slow, too many connections) in the OpenAI error
shape like every other answer.

uvicorn bounds the idle time between requests (`timeout_keep_alive`), the connections (`limit_concurrency`) and a
head's size (`h11_max_incomplete_event_size`), but not the time a client takes to send a head or a body: a client
that sends a header line every few seconds (slowloris), opens a connection and sends nothing, or announces a large
body and trickles it in, holds its connection, and for a body the memory it fills, for as long as it likes. uvicorn
takes its HTTP protocol as a class; `protocol(limits)` is its h11 protocol with two deadlines added: a request's
head must arrive within `header_timeout` of the connection opening or of its first byte, and its body within
`body_timeout` of the head. A connection past one is answered 408 (nothing, if it never sent a byte) and closed;
the app reading the body sees the client gone.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import ApiError
from .limits import Limits


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI-shaped error, closing the connection (for answers written
    before or beside the app)."""
    body = json.dumps(ApiError(status, message, code=code).body()).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _Connection(h11.Connection):
    """h11's connection, keeping the protocol error it raised last (its status hint tells a head too large, 431)."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on a request's head and body, and errors in the OpenAI shape."""

    limits: ClassVar[Limits] = Limits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, self.limits.max_header_bytes)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "head" or "body": what the running deadline is for
        # uvicorn's own check answers in plain text: this protocol checks the same limit in _admit instead.
        self._cap, self.limit_concurrency = self.limit_concurrency, None
        self._app, self.app = self.app, self._admit

    # -- the deadlines ------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head")  # a connection that never sends a request is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._phase is None:
            self._arm("head")  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.get_protocol() is not self:  # upgraded to a WebSocket (realtime.py): no HTTP deadlines
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        elif state is h11.IDLE:
            if self._phase is None and self.conn.trailing_data[0]:  # a pipelined request's head, begun
                self._arm("head")
        else:  # the request is in (DONE), or the connection is ending
            self._disarm()

    def _arm(self, phase: str) -> None:
        self._disarm()
        seconds = self.limits.header_timeout if phase == "head" else self.limits.body_timeout
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._phase = None

    def _expired(self, phase: str) -> None:
        self._deadline = self._phase = None
        if self.transport.is_closing():
            return
        if phase == "head":
            if self.conn.trailing_data[0]:  # a head begun, not finished
                self._refuse(408, f"the request's head did not arrive within {self.limits.header_timeout:g} s "
                                  "(--header-timeout)", "request_timeout")
            else:  # idle: nothing was asked, nothing to answer
                self.transport.close()
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._refuse(408, f"the request's body did not arrive within {self.limits.body_timeout:g} s "
                              "(--body-timeout)", "request_timeout")
            cycle.disconnected = True  # the app reading the body sees the client gone; what it answers is dropped
            cycle.message_event.set()
        else:  # answered already (an early 401, 413, 429): the rest of the body is not waited for
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        self.transport.write(error_response(status, message, code))
        self.transport.close()

    # -- uvicorn's own answers, in the OpenAI shape -------------------------
    def send_400_response(self, msg: str) -> None:
        error = getattr(self.conn, "error", None)
        if error is not None and error.error_status_hint == 431:
            self._refuse(431, f"the request's head is larger than {self.limits.max_header_bytes >> 10} KB",
                         "request_header_fields_too_large")
        else:
            self._refuse(400, f"malformed HTTP request{f' ({error})' if error else ''}", "invalid_request")

    async def _admit(self, scope: Any, receive: Any, send: Any) -> None:
        """uvicorn's `limit_concurrency`, answered as an OpenAI error: a request on a connection beyond the limit
        (or beyond as many requests in flight) gets 503 and its connection is closed."""
        if self._cap is not None and (len(self.connections) > self._cap or len(self.tasks) > self._cap):
            body = json.dumps(ApiError(503, f"the server has {self._cap} connections open, its limit "
                                            "(--max-connections): retry in a moment", code="server_busy").body())
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await self._app(scope, receive, send)


def protocol(limits: Limits) -> type[LimitedH11Protocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), with these limits."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})
