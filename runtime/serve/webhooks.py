"""Webhooks: each tenant's endpoints (`/v1/webhook_endpoints`, as the openai SDK's `client.webhooks` calls them), and
the durable, signed delivery of its jobs' ends to them, so that nobody has to poll.

- **Events.** When a job ends, the transaction that ends it (runtime/serve/jobs.py) writes one delivery per endpoint of
  the job's tenant subscribed to the event's type, and one to the server's own endpoint (`--webhook-url`, every
  tenant's events, both types): OpenAI's event shape, `{"id": "evt_...", "object": "event", "type": "video.completed"
  | "video.failed", "created_at": ..., "data": {"id": VIDEO_ID}}`. A job cancelled with POST .../cancel is
  `video.failed` (its error code is `cancelled`); a deleted one has no event.
- **Delivery.** Deliveries wait in the job database until an endpoint answers 2xx, so they survive restarts, and any
  replica sends them (`Sender`: a few threads claim due ones, one replica each, under a short lock; SELECT ... FOR
  UPDATE SKIP LOCKED on PostgreSQL). At least once, with a stable `webhook-id` (the delivery's id) on every attempt;
  a failed attempt (no answer in DELIVERY_TIMEOUT, an error, any non-2xx, a redirect) is retried after 1, 2, 4, ...
  seconds, at most an hour apart, until `--webhook-retry-for` seconds (a day) after the event, then given up (logged).
  The host's name is looked up for at most RESOLVE_TIMEOUT seconds (`getaddrinfo` has no timeout of its own, and a
  resolver slow to say no would hold a sender, or a request, for 10-15 s), the connection opened in at most
  CONNECT_TIMEOUT: a name with no answer by then does not resolve, for this attempt.
- **Signatures**, per Standard Webhooks (standardwebhooks.com): headers `webhook-id`, `webhook-timestamp` (seconds) and
  `webhook-signature: v1,<base64 HMAC-SHA256(key, id + "." + timestamp + "." + body)>`, the key being the base64
  after `whsec_` of the endpoint's secret (both the new and the old one for 24 hours after a rotation that keeps it).
  The SDK's `client.webhooks.unwrap(body, headers, secret=...)` verifies them.
- **Security.** An endpoint's URL must be http(s), and every address its host resolves to must be globally routable:
  a private, loopback, link-local (the cloud metadata service, 169.254.169.254), shared or reserved address is refused
  (400) unless `--webhook-allow HOST[,HOST]` names the host, the address or a network holding it (CIDR). The check is
  made again at every send, and the connection goes to the address that passed it (a DNS answer that changes between
  the check and the connection cannot reach another one); redirects are not followed. Secrets are kept in the job
  database (the server must sign with them): protect it as the API keys.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import re
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from fastapi import Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from ..errors import UserError
from .db import DatabaseUnavailable
from .errors import ApiError

log = logging.getLogger("runtime")

EVENT_TYPES = ("video.completed", "video.failed")
DELIVERY_TIMEOUT = 10.0  # seconds each read or write of an attempt may wait: the request sent, the answer's status
RESOLVE_TIMEOUT = 3.0  # seconds an endpoint's host name may take to resolve (the lookup runs in a thread: `lookup`)
CONNECT_TIMEOUT = 3.0  # seconds to open the connection to the address that passed the check
LOCK_S = 60.0  # a claimed delivery is this replica's for this long (more than one attempt takes)
MAX_BACKOFF = 3600.0
DEFAULT_RETRY_FOR = 86400.0  # --webhook-retry-for
SENDERS = 4  # threads per replica sending deliveries (a slow endpoint holds up one)
KEEP_OLD_SECRET_S = 86400.0
MAX_URL = 2048
SERVER = "server"  # the endpoint name of --webhook-url's deliveries


def backoff(attempts: int) -> float:
    """Seconds until the next attempt after `attempts` failed ones: 1, 2, 4, ..., at most an hour."""
    return min(MAX_BACKOFF, 2.0 ** max(0, attempts - 1))


# -- where deliveries may go ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Allow:
    """`--webhook-allow`: host names, addresses and networks a webhook may reach although not globally routable."""

    names: frozenset[str] = frozenset()
    networks: tuple[Any, ...] = ()

    @classmethod
    def parse(cls, values: Iterable[str]) -> Allow:
        names, networks = set(), []
        for value in (v.strip() for item in values for v in item.split(",")):
            if not value:
                continue
            try:
                networks.append(ipaddress.ip_network(value.strip("[]"), strict=False))
            except ValueError:
                names.add(value.lower().rstrip("."))
        return cls(frozenset(names), tuple(networks))

    def allows(self, host: str, address: Any) -> bool:
        return host.lower().rstrip(".") in self.names or any(address in n for n in self.networks
                                                                if n.version == address.version)


def routable(address: Any) -> bool:
    """Globally routable: not private, loopback, link-local, shared (100.64/10), reserved, unspecified or multicast
    (an IPv4-mapped IPv6 address as its IPv4 one)."""
    address = getattr(address, "ipv4_mapped", None) or address
    return address.is_global and not address.is_multicast


class Refused(ValueError):
    """A URL a webhook may not be sent to (the message says why and what to do)."""


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_NAME = rf"(?:{_LABEL}\.)+[A-Za-z]{{2,63}}\.?"  # a DNS name whose last label is letters: an address is not one
_PORT = r"(?::(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3}))?"
_REST = r"(?:[/?#][!-~]*)?"  # a path, query and fragment of visible ASCII (anything else percent-encoded)


def url_pattern(allow: Allow) -> str:
    """The URLs an endpoint may have, as a regular expression JSON Schema (ECMA-262) and Python read alike: http(s), a
    host name with a dot and a letters-only last label (an IP address, or a name like `localhost`, only where
    --webhook-allow names it exactly), an optional port, visible ASCII after. Where the name resolves is checked
    besides (`resolve`)."""
    literal = [re.escape(n) for n in sorted(allow.names)]
    literal += [re.escape(str(n.network_address) if n.version == 4 else f"[{n.network_address}]")
                for n in allow.networks if n.num_addresses == 1]
    return rf"^https?://(?:{'|'.join([HOST_NAME, *literal])}){_PORT}{_REST}$"


def resolve(url: str, allow: Allow, unresolved_ok: bool = False) -> tuple[Any, str, int, list[Any]]:
    """(the URL's parts, its host, its port, the addresses it may be sent to); Refused if it is not one `url_pattern`
    takes, or its host resolves to an address that is not routable and not allowed, or (unless `unresolved_ok`: an
    endpoint is made before its name exists, and each delivery resolves it again) does not resolve."""
    if not isinstance(url, str) or len(url) > MAX_URL:
        raise Refused(f"url must be an http(s) URL of at most {MAX_URL} characters")
    if not re.fullmatch(url_pattern(allow), url):
        raise Refused(f"url {url[:100]!r} must be http:// or https:// with a host name (an IP address, or a name "
                      "without a dot such as localhost, only where the server's --webhook-allow names it: webhooks go "
                      "to public hosts), an optional port, then a path of visible ASCII")
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    try:
        infos = lookup(host, port)
    except (socket.gaierror, UnicodeError, TimeoutError) as e:
        if unresolved_ok:
            return parts, host, port, []
        raise Refused(f"url's host {host!r} does not resolve ({e})") from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos))
    for address in addresses:
        if not routable(address) and not allow.allows(host, address):
            raise Refused(f"url's host {host!r} is {address}, a private, loopback or link-local address: webhooks go "
                          f"to public addresses only, unless the server is started with --webhook-allow {host}")
    return parts, host, port, addresses


def lookup(host: str, port: int, timeout: float | None = None) -> list[Any]:
    """`socket.getaddrinfo(host, port)` for TCP, given up after `timeout` seconds (RESOLVE_TIMEOUT): TimeoutError.
    getaddrinfo cannot be interrupted, so it runs in a daemon thread of its own, left to end when the system's resolver
    gives up (that thread holds nothing: its answer is dropped); its own error (socket.gaierror) is raised here."""
    timeout = RESOLVE_TIMEOUT if timeout is None else timeout
    done = threading.Event()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except Exception as e:  # noqa: BLE001  (raised in the caller's thread)
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="webhook-lookup", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"no answer from the resolver within {timeout:g} s")
    if "error" in out:
        raise out["error"]
    return out["infos"]


def _connect(address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to `address`, opened within CONNECT_TIMEOUT; its reads and writes then wait up to `timeout`."""
    sock = socket.create_connection((address, port), min(CONNECT_TIMEOUT, timeout))
    sock.settimeout(timeout)
    return sock


class _Pinned(http.client.HTTPConnection):
    """HTTP to the address that passed the check, whatever the name resolves to now."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = _connect(self._address, self.port, self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    """HTTPS to the address that passed the check, the certificate checked against the URL's host name."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = _connect(self._address, self.port, self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


def post(url: str, body: bytes, headers: dict[str, str], allow: Allow, timeout: float = DELIVERY_TIMEOUT) -> int:
    """POST `body` to `url` (checked again, then reached at the checked address); the answer's status. Refused (its
    name not resolved within RESOLVE_TIMEOUT among the reasons), or OSError / http.client errors (no connection within
    CONNECT_TIMEOUT among them), where it cannot be sent."""
    parts, host, port, addresses = resolve(url, allow)
    cls = _PinnedTLS if parts.scheme == "https" else _Pinned
    conn = cls(host, port, str(addresses[0]), timeout)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                       "User-Agent": "wan-aot-webhooks/1", **headers})
        response = conn.getresponse()
        response.read(1 << 16)
        return response.status
    finally:
        conn.close()


# -- signatures -------------------------------------------------------------------------------------------------
def new_secret() -> str:
    """A Standard Webhooks secret: whsec_ and the base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def check_secret(secret: str, what: str = "--webhook-secret") -> str:
    """UserError unless `secret` is whsec_ and the base64 of 24 to 64 bytes."""
    secret = (secret or "").strip()
    try:
        key = base64.b64decode(secret[6:], validate=True) if secret.startswith("whsec_") else b""
    except ValueError:
        key = b""
    if not 24 <= len(key) <= 64:
        make = "import base64, secrets; print('whsec_' + base64.b64encode(secrets.token_bytes(32)).decode())"
        raise UserError(f"{what} must be whsec_ and the base64 of 24 to 64 random bytes (make one with: python -c "
                        f"\"{make}\")")
    return secret


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret[len("whsec_"):])
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signed_headers(secrets_: Iterable[str], msg_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    timestamp = int(time.time() if now is None else now)
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(signature(s, msg_id, timestamp, body) for s in secrets_)}


def event(event_type: str, video_id: str) -> dict[str, Any]:
    return {"id": "evt_" + secrets.token_hex(12), "object": "event", "type": event_type,
            "created_at": int(time.time()), "data": {"id": video_id}}


# -- settings ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """The server's webhook settings (`serve` flags)."""

    allow: Allow = field(default_factory=Allow)  # --webhook-allow
    url: str | None = None  # --webhook-url: the server's own endpoint, every tenant's events
    secret: str | None = None  # --webhook-secret
    retry_for: float = DEFAULT_RETRY_FOR  # --webhook-retry-for

    @classmethod
    def of(cls, url: str | None, secret: str | None, allow: Iterable[str] = (),
           retry_for: float = DEFAULT_RETRY_FOR) -> Config:
        """Checked: one line (UserError) for a bad URL or secret, before anything starts."""
        allowed = Allow.parse(allow)
        if secret and not url:
            raise UserError("--webhook-secret goes with --webhook-url (the endpoint it signs for)")
        if url:
            if not secret:
                raise UserError("--webhook-url needs --webhook-secret whsec_... (or WAN_AOT_WEBHOOK_SECRET): the "
                                "receiver checks each delivery's signature with it")
            secret = check_secret(secret)
            try:
                resolve(url, allowed, unresolved_ok=True)  # (a name that resolves only later is tried at each send)
            except Refused as e:
                raise UserError(f"--webhook-url: {e}") from None
        if not retry_for > 0:
            raise UserError(f"--webhook-retry-for {retry_for} must be a number of seconds > 0")
        return cls(allowed, url or None, secret or None, float(retry_for))


# -- the database -----------------------------------------------------------------------------------------------
class Events:
    """jobs.Events: a job's end, as deliveries to its tenant's endpoints (and the server's), in the job's
    transaction; `now` is the database clock's SQL (db.Database.now)."""

    def __init__(self, config: Config, now: str) -> None:
        self.config, self.now = config, now

    def job_ended(self, tx: Any, tenant: str, video_id: str, event_type: str) -> None:
        payload = json.dumps(event(event_type, video_id), separators=(",", ":"))
        rows = tx.all("SELECT id, event_types FROM wan_aot_webhook_endpoints WHERE tenant = ? ORDER BY seq", (tenant,))
        targets: list[tuple[str, str | None]] = [(eid, None) for eid, types in rows if event_type in json.loads(types)]
        if self.config.url:
            targets.append((SERVER, self.config.url))
        for endpoint, url in targets:
            tx.execute(f"INSERT INTO wan_aot_webhook_deliveries (id, endpoint, url, payload, created_at, next_attempt) "
                       f"VALUES (?, ?, ?, ?, {self.now}, {self.now})", ("msg_" + secrets.token_hex(12), endpoint, url,
                                                                       payload))


@dataclass
class Endpoint:
    id: str
    seq: int
    tenant: str
    name: str
    url: str
    event_types: list[str]
    secret: str
    old_secret: str | None
    old_secret_until: float | None
    created_at: int
    updated_at: int

    def to_api(self, with_secret: bool = False) -> dict[str, Any]:
        out = {"id": self.id, "object": "webhook_endpoint", "created_at": self.created_at,
               "updated_at": self.updated_at, "name": self.name, "url": self.url, "event_types": self.event_types,
               "signing_secret_hint": f"whsec_...{self.secret[-4:]}"}
        return {**out, "signing_secret": self.secret} if with_secret else out

    def secrets(self, now: float) -> list[str]:
        """The secrets a delivery is signed with now: the secret, and the old one within its 24 hours."""
        keep = self.old_secret is not None and self.old_secret_until is not None and now < self.old_secret_until
        return [self.secret, self.old_secret] if keep else [self.secret]  # type: ignore[list-item]


_ENDPOINT = "id, seq, tenant, name, url, event_types, secret, old_secret, old_secret_until, created_at, updated_at"


def _endpoint(row: tuple) -> Endpoint:
    (eid, seq, tenant, name, url, types, secret, old, until, created, updated) = row
    return Endpoint(eid, int(seq), tenant, name, url, json.loads(types), secret, old,
                    None if until is None else float(until), int(created), int(updated))


class Endpoints:
    """A tenant's endpoints in the job database: every method takes the tenant, and another's is not there."""

    def __init__(self, db: Any) -> None:
        self.db = db

    def create(self, tenant: str, name: str, url: str, event_types: list[str]) -> Endpoint:
        eid = "we_" + secrets.token_hex(12)
        with self.db.transaction(exclusive=True) as tx:
            seq = tx.one("SELECT COALESCE(MAX(seq), 0) + 1 FROM wan_aot_webhook_endpoints")[0]
            tx.execute(f"INSERT INTO wan_aot_webhook_endpoints ({_ENDPOINT}) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL, "
                       f"{self.db.now_int}, {self.db.now_int})",
                       (eid, seq, tenant, name, url, json.dumps(event_types), new_secret()))
        return self.get(tenant, eid)  # type: ignore[return-value]

    def get(self, tenant: str, eid: str) -> Endpoint | None:
        with self.db.transaction(exclusive=False) as tx:
            row = tx.one(f"SELECT {_ENDPOINT} FROM wan_aot_webhook_endpoints WHERE id = ? AND tenant = ?",
                         (eid, tenant))
        return None if row is None else _endpoint(row)

    def by_id(self, eid: str) -> Endpoint | None:
        with self.db.transaction(exclusive=False) as tx:
            row = tx.one(f"SELECT {_ENDPOINT} FROM wan_aot_webhook_endpoints WHERE id = ?", (eid,))
        return None if row is None else _endpoint(row)

    def list(self, tenant: str, limit: int, after: str | None = None) -> tuple[list[Endpoint], bool]:
        """Newest first, after the endpoint `after` (KeyError if it is not the tenant's)."""
        where, args = "tenant = ?", (tenant,)
        if after is not None:
            anchor = self.get(tenant, after)
            if anchor is None:
                raise KeyError(after)
            where, args = where + " AND seq < ?", (*args, anchor.seq)
        with self.db.transaction(exclusive=False) as tx:
            rows = tx.all(f"SELECT {_ENDPOINT} FROM wan_aot_webhook_endpoints WHERE {where} ORDER BY seq DESC "
                          "LIMIT ?", (*args, limit + 1))
        return [_endpoint(r) for r in rows[:limit]], len(rows) > limit

    def update(self, tenant: str, eid: str, changes: dict[str, Any]) -> Endpoint | None:
        sets = [f"{k} = ?" for k in changes] + [f"updated_at = {self.db.now_int}"]
        values = [json.dumps(v) if k == "event_types" else v for k, v in changes.items()]
        with self.db.transaction(exclusive=False) as tx:
            n = tx.execute(f"UPDATE wan_aot_webhook_endpoints SET {', '.join(sets)} WHERE id = ? AND tenant = ?",
                           (*values, eid, tenant))
        return self.get(tenant, eid) if n else None

    def rotate(self, tenant: str, eid: str, keep_old: bool) -> Endpoint | None:
        with self.db.transaction(exclusive=False) as tx:
            n = tx.execute("UPDATE wan_aot_webhook_endpoints SET old_secret = CASE WHEN ? THEN secret ELSE NULL END, "
                           f"old_secret_until = CASE WHEN ? THEN {self.db.now} + ? ELSE NULL END, secret = ?, "
                           f"updated_at = {self.db.now_int} WHERE id = ? AND tenant = ?",
                           (keep_old, keep_old, KEEP_OLD_SECRET_S, new_secret(), eid, tenant))
        return self.get(tenant, eid) if n else None

    def delete(self, tenant: str, eid: str) -> bool:
        with self.db.transaction(exclusive=False) as tx:
            n = tx.execute("DELETE FROM wan_aot_webhook_endpoints WHERE id = ? AND tenant = ?", (eid, tenant))
            if n:  # its deliveries waiting go with it
                tx.execute("UPDATE wan_aot_webhook_deliveries SET state = 'dropped', done_at = "
                           f"{self.db.now} WHERE endpoint = ? AND state = 'pending'", (eid,))
        return bool(n)


# -- sending ----------------------------------------------------------------------------------------------------
@dataclass
class Delivery:
    id: str
    endpoint: str
    url: str | None
    payload: str
    attempts: int
    created_at: float


class Sender:
    """SENDERS threads that claim due deliveries from the shared database and send them until stopped; `wake()` when
    a job ended here (its deliveries are due now). Outcomes are counted in `wan_aot_webhook_deliveries_total`."""

    def __init__(self, db: Any, config: Config, registry: Any = None, threads: int = SENDERS) -> None:
        self.db, self.config = db, config
        self.endpoints = Endpoints(db)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name=f"wan-aot-webhooks-{i}", daemon=True)
                         for i in range(threads)]
        self.counter = None
        if registry is not None:
            from prometheus_client import Counter, Gauge

            self.counter = Counter("wan_aot_webhook_deliveries", "webhook delivery attempts this replica made, by "
                                   "outcome (retried: it failed and will be tried again; given_up: out of time)",
                                   ["outcome"], registry=registry)
            for outcome in ("delivered", "retried", "given_up", "dropped"):
                self.counter.labels(outcome)
            pending = Gauge("wan_aot_webhook_pending", "webhook deliveries waiting, in the shared database",
                            registry=registry)
            pending.set_function(self.pending)

    def start(self) -> Sender:
        for t in self._threads:
            t.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout)

    def pending(self) -> float:
        try:
            with self.db.transaction(exclusive=False) as tx:
                return int(tx.one("SELECT COUNT(*) FROM wan_aot_webhook_deliveries WHERE state = 'pending'")[0])
        except DatabaseUnavailable:  # a scrape while the database is away
            return float("nan")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                delivery = self.claim()
            except DatabaseUnavailable:  # the database layer says so once, and when it is back; due ones wait
                delivery = None
            except Exception as e:  # noqa: BLE001  (the database is away for a moment: stay up, try again)
                log.warning("webhooks: cannot read the deliveries: %s: %s", type(e).__name__, e)
                delivery = None
            if delivery is None:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            self.send(delivery)
            self._wake.set()  # there may be more: the other threads look too

    def claim(self) -> Delivery | None:
        """A due delivery, now this replica's until LOCK_S passes, or None."""
        now = self.db.now
        server = "" if self.config.secret else f" AND endpoint != '{SERVER}'"  # those only a replica with the secret
        with self.db.transaction(exclusive=False) as tx:
            row = tx.one("SELECT id, endpoint, url, payload, attempts, created_at FROM wan_aot_webhook_deliveries "
                         f"WHERE state = 'pending' AND next_attempt <= {now} AND locked_until <= {now}{server} "
                         f"ORDER BY next_attempt LIMIT 1{self.db.skip_locked}")
            if row is None:
                return None
            n = tx.execute(f"UPDATE wan_aot_webhook_deliveries SET locked_until = {now} + ? WHERE id = ? AND "
                           f"locked_until <= {now}", (LOCK_S, row[0]))
        return Delivery(row[0], row[1], row[2], row[3], int(row[4]), float(row[5])) if n == 1 else None

    def send(self, d: Delivery) -> None:
        """One attempt; the outcome recorded (delivered, retried later, given up, or dropped: its endpoint is gone)."""
        if d.endpoint == SERVER:
            url, keys = d.url, [self.config.secret]
        else:
            endpoint = self.endpoints.by_id(d.endpoint)
            if endpoint is None:
                self._record(d, "dropped", "the endpoint was deleted")
                return
            url, keys = endpoint.url, endpoint.secrets(time.time())
        body = d.payload.encode()
        try:
            status = post(url, body, signed_headers(keys, d.id, body), self.config.allow)  # type: ignore[arg-type]
            error = None if 200 <= status < 300 else f"answered {status}"
        except Refused as e:
            error = str(e)
        except (OSError, http.client.HTTPException) as e:
            error = f"{type(e).__name__}: {e}"
        if error is None:
            self._record(d, "delivered")
            return
        given_up = time.time() + backoff(d.attempts + 1) - d.created_at > self.config.retry_for
        log.warning("webhook %s to %s failed (attempt %d): %s%s", d.id, url, d.attempts + 1, error,
                    "; given up (--webhook-retry-for)" if given_up else "")
        self._record(d, "given_up" if given_up else "retried", error)

    def _record(self, d: Delivery, outcome: str, error: str | None = None) -> None:
        now = self.db.now
        state = {"delivered": "delivered", "given_up": "failed", "dropped": "dropped", "retried": "pending"}[outcome]
        try:
            with self.db.transaction(exclusive=False) as tx:
                tx.execute(f"UPDATE wan_aot_webhook_deliveries SET state = ?, attempts = attempts + 1, last_error = ?, "
                           f"locked_until = 0, next_attempt = {now} + ?, done_at = CASE WHEN ? THEN {now} ELSE NULL "
                           "END WHERE id = ?", (state, error, backoff(d.attempts + 1), state != "pending", d.id))
        except Exception as e:  # noqa: BLE001  (its lock runs out: it is sent again, at least once)
            log.warning("webhooks: cannot record delivery %s: %s: %s", d.id, type(e).__name__, e)
        if self.counter is not None:
            self.counter.labels(outcome).inc()


# -- the API ----------------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


EventType = Literal["video.completed", "video.failed"]
Name = Annotated[str, Field(min_length=1, max_length=256, description="a human-readable name")]
Url = Annotated[str, Field(min_length=1, max_length=MAX_URL, description="the http(s) URL deliveries are POSTed to: "
                           "a host name that resolves to public addresses (an IP address, or a private, loopback or "
                           "link-local one, needs the server's --webhook-allow)")]
Types = Annotated[list[EventType], Field(min_length=1, description="the event types delivered to it")]


class EndpointCreate(_Strict):
    name: Name
    url: Url
    event_types: Types


class EndpointUpdate(_Strict):
    name: Name | None = None
    url: Url | None = None
    event_types: Types | None = None


class RotateSecret(_Strict):
    keep_old_secret_active_for_24_hours: bool = Field(False, description="sign with the old secret too for 24 hours")


class EndpointTest(_Strict):
    event_type: EventType


class WebhookEndpoint(_Strict):
    id: str
    object: Literal["webhook_endpoint"]
    created_at: int
    updated_at: int
    name: str
    url: str
    event_types: list[str]
    signing_secret_hint: str


class WebhookEndpointWithSecret(WebhookEndpoint):
    signing_secret: str = Field(description="whsec_...: shown when the endpoint is made and when its secret rotates")


class WebhookEndpointList(_Strict):
    object: Literal["list"]
    data: list[WebhookEndpoint]
    first_id: str | None
    last_id: str | None
    has_more: bool


class WebhookEndpointDeleted(_Strict):
    id: str
    object: Literal["webhook_endpoint.deleted"]
    deleted: bool


class WebhookEndpointTestResult(_Strict):
    object: Literal["webhook_endpoint.test"]
    event_type: str
    status_code: int = Field(description="the endpoint's answer's HTTP status, or 0: no answer (error says why)")
    success: bool = Field(description="whether the endpoint answered 2xx (as a delivery counts as delivered)")
    webhook_endpoint_id: str
    error: str | None = Field(description="why no answer came (status_code is then 0), or null")


class EventTypeList(_Strict):
    object: Literal["list"]
    data: list[str]


EndpointId = Annotated[str, Path(description="a webhook endpoint's id")]


def _body(model: type[BaseModel], allow: Allow | None = None) -> dict[str, Any]:
    """A request body's document; an endpoint's `url` with the pattern this server takes (url_pattern)."""
    schema = model.model_json_schema()
    url = schema.get("properties", {}).get("url")
    if url is not None and allow is not None:
        for branch in url.get("anyOf", [url]):
            if branch.get("type") == "string":
                branch["pattern"] = url_pattern(allow)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _parse(request: Any, model: type[_Strict]) -> Any:
    """The JSON body as `model`: 415 for another media type, 400 naming the field at fault."""
    from .schema import read_limited

    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"unsupported content type {media or '(none)'!r}: send application/json")
    try:
        data = json.loads(await read_limited(request, 1 << 16))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e})") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else None
        raise ApiError(400, f"{param or 'the body'}: {first['msg']}", param) from None


def add_routes(app: Any, state: Any) -> None:
    """The webhook endpoint routes, each a tenant's own (another's id is a 404, as an unknown one)."""
    from . import openapi as oa

    endpoints = Endpoints(state.store.db)
    config: Config = state.settings.webhooks

    def mine(request: Request, eid: str) -> Endpoint:
        found = endpoints.get(request.state.tenant, eid)
        if found is None:
            raise ApiError(404, f"no webhook endpoint {eid!r}")
        return found

    def checked(url: str) -> str:
        try:
            resolve(url, config.allow, unresolved_ok=True)
        except Refused as e:
            raise ApiError(400, str(e), "url") from None
        return url

    @app.get("/v1/webhook_event_types", operation_id="listWebhookEventTypes", response_model=None,
             summary="The event types webhooks deliver", responses={200: {"model": EventTypeList}})
    def event_types() -> dict[str, Any]:
        return {"object": "list", "data": list(EVENT_TYPES)}

    @app.post("/v1/webhook_endpoints", operation_id="createWebhookEndpoint", response_model=None,
              summary="Make a webhook endpoint (its signing_secret is shown now, and at a rotation)",
              openapi_extra=_body(EndpointCreate, config.allow),
              responses={200: {"model": WebhookEndpointWithSecret}, **oa.errors(400, 415)})
    async def create(request: Request) -> dict[str, Any]:
        body = await _parse(request, EndpointCreate)
        url = await run_in_threadpool(checked, body.url)
        made = await run_in_threadpool(endpoints.create, request.state.tenant, body.name, url,
                                       list(dict.fromkeys(body.event_types)))
        return made.to_api(with_secret=True)

    @app.get("/v1/webhook_endpoints", operation_id="listWebhookEndpoints", response_model=None,
             summary="Your webhook endpoints, newest first", responses={200: {"model": WebhookEndpointList},
                                                                        **oa.errors(400, 404)})
    def list_endpoints(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                       after: Annotated[str | None, Query(description="list the endpoints after this id")] = None
                       ) -> dict[str, Any]:
        try:
            page, more = endpoints.list(request.state.tenant, limit, after)
        except KeyError:
            raise ApiError(404, f"after {after!r} is not a webhook endpoint of yours", "after") from None
        data = [e.to_api() for e in page]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/webhook_endpoints/{webhook_endpoint_id}", operation_id="retrieveWebhookEndpoint",
             response_model=None, summary="A webhook endpoint",
             responses={200: {"model": WebhookEndpoint}, **oa.errors(404)})
    def retrieve(request: Request, webhook_endpoint_id: EndpointId) -> dict[str, Any]:
        return mine(request, webhook_endpoint_id).to_api()

    @app.post("/v1/webhook_endpoints/{webhook_endpoint_id}", operation_id="updateWebhookEndpoint",
              response_model=None, summary="Change a webhook endpoint's name, url or event types",
              openapi_extra=_body(EndpointUpdate, config.allow),
              responses={200: {"model": WebhookEndpoint}, **oa.errors(400, 404, 415)})
    async def update(request: Request, webhook_endpoint_id: EndpointId) -> dict[str, Any]:
        body = await _parse(request, EndpointUpdate)
        mine(request, webhook_endpoint_id)
        changes = {k: v for k, v in body.model_dump().items() if v is not None}
        if "url" in changes:
            await run_in_threadpool(checked, changes["url"])
        if "event_types" in changes:
            changes["event_types"] = list(dict.fromkeys(changes["event_types"]))
        changed = endpoints.update(request.state.tenant, webhook_endpoint_id, changes)
        if changed is None:
            raise ApiError(404, f"no webhook endpoint {webhook_endpoint_id!r}")
        return changed.to_api()

    @app.delete("/v1/webhook_endpoints/{webhook_endpoint_id}", operation_id="deleteWebhookEndpoint",
                response_model=None, summary="Delete a webhook endpoint (its waiting deliveries too)",
                responses={200: {"model": WebhookEndpointDeleted}, **oa.errors(404)})
    def delete(request: Request, webhook_endpoint_id: EndpointId) -> dict[str, Any]:
        if not endpoints.delete(request.state.tenant, webhook_endpoint_id):
            raise ApiError(404, f"no webhook endpoint {webhook_endpoint_id!r}")
        return {"id": webhook_endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}

    @app.post("/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret", operation_id="rotateWebhookEndpointSecret",
              response_model=None, summary="A new signing secret (the old one may sign for 24 hours more)",
              openapi_extra=_body(RotateSecret),
              responses={200: {"model": WebhookEndpointWithSecret}, **oa.errors(400, 404, 415)})
    async def rotate(request: Request, webhook_endpoint_id: EndpointId) -> dict[str, Any]:
        body = await _parse(request, RotateSecret)
        rotated = endpoints.rotate(request.state.tenant, webhook_endpoint_id, body.keep_old_secret_active_for_24_hours)
        if rotated is None:
            raise ApiError(404, f"no webhook endpoint {webhook_endpoint_id!r}")
        return rotated.to_api(with_secret=True)

    @app.post("/v1/webhook_endpoints/{webhook_endpoint_id}/test", operation_id="testWebhookEndpoint",
              response_model=None, summary="Send the endpoint a sample event now (of a video `video_test`), signed",
              openapi_extra=_body(EndpointTest),
              responses={200: {"model": WebhookEndpointTestResult}, **oa.errors(400, 404, 415)})
    async def test(request: Request, webhook_endpoint_id: EndpointId) -> dict[str, Any]:
        body = await _parse(request, EndpointTest)
        endpoint = mine(request, webhook_endpoint_id)
        payload = json.dumps(event(body.event_type, "video_test"), separators=(",", ":")).encode()
        msg_id = "msg_" + secrets.token_hex(12)
        status: int
        error: str | None
        try:
            status = await run_in_threadpool(post, endpoint.url, payload,
                                             signed_headers(endpoint.secrets(time.time()), msg_id, payload),
                                             config.allow)
            error = None
        except (Refused, OSError, http.client.HTTPException) as e:  # (its name may resolve elsewhere by now)
            status, error = 0, f"the endpoint could not be reached: {type(e).__name__}: {e}"
        return {"object": "webhook_endpoint.test", "event_type": body.event_type, "status_code": status,
                "success": 200 <= status < 300, "webhook_endpoint_id": endpoint.id, "error": error}
