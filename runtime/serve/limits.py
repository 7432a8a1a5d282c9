"""What one client may hold of the server, bounded: the time to send a request's head and its body, the idle time
between requests, the connections, the bodies read and the media decoded at once, a body's and a head's size.

The time limits and the connections are enforced where the bytes arrive, in uvicorn's protocol (protocol.py); the
body's size by the app's guard and the body reader (routes.py, schema.py); the uploads and decodes at once by the
create route (`Slots`, and a semaphore around the checks that decode media).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import ApiError

MAX_HEADER_BYTES = 16 << 10  # a request's head (h11's default); more is a 431


@dataclass(frozen=True)
class Limits:
    """The server's limits (`serve` flags in brackets)."""

    header_timeout: float = 10.0  # seconds to send a request's head [--header-timeout]
    body_timeout: float = 60.0  # seconds to send a request's body, from its head [--body-timeout]
    keep_alive: float = 5.0  # seconds a connection may idle between requests [--keep-alive]
    max_connections: int = 256  # connections open at once; a request on one more gets 503 [--max-connections]
    max_uploads: int = 8  # create requests reading a body or checking it at once; more get 503 [--max-uploads]
    max_decodes: int = 2  # requests decoding their media at once; more wait [--max-decodes]
    # one request's body; more is a 413 [--max-body-mb]; None: the bundle's (Offer.max_body_bytes: 32 MB, 256 MB for a
    # bundle that takes videos)
    max_body_bytes: int | None = None
    max_header_bytes: int = MAX_HEADER_BYTES  # one request's head; more is a 431
    # realtime sessions (realtime.py): a connection that starts none within this many seconds is closed
    # [--realtime-idle-timeout]; a session stops after this many [--realtime-max-seconds]; a client's message over
    # this many bytes closes its connection with 1009 [--realtime-max-message-kb]
    realtime_idle: float = 60.0
    realtime_max_seconds: float = 600.0
    realtime_max_message_bytes: int = 64 << 10


class Slots:
    """At most `n` at once, the rest refused at once (503 with Retry-After) rather than left waiting with what they
    hold. Used from the event loop only (no lock needed)."""

    def __init__(self, n: int, what: str) -> None:
        self.n, self.what, self.used = n, what, 0

    @contextlib.contextmanager
    def take(self) -> Iterator[None]:
        if self.used >= self.n:
            raise ApiError(503, f"the server is {self.what} already ({self.n}, its limit): retry in a moment",
                           code="server_busy", headers={"Retry-After": "1"})
        self.used += 1
        try:
            yield
        finally:
            self.used -= 1
