"""The job database: SQLite under the jobs directory (the default, one server) or PostgreSQL (several replicas).

One small interface, `Database`: `transaction(exclusive)` yields a `Tx` whose `one`, `all` and `execute` take
SQL with `?` placeholders, and three dialect snippets (`now`, `now_int`, `skip_locked`). runtime/serve/jobs.py
writes every statement once against it. An exclusive transaction is serialized with every other exclusive one
(SQLite: BEGIN IMMEDIATE; PostgreSQL: a transaction-scoped advisory lock), which makes "count the queue, then
insert" one atomic step across replicas.

The schema is created on first start (`CREATE TABLE IF NOT EXISTS`, under the same lock on PostgreSQL, so
several replicas starting at once on an empty database are safe) with a version row; a database of an older version
is upgraded in place (version 2 added the tenant a job belongs to, `default` for the jobs before, and when each
tenant was last served; version 3 the webhook endpoints and deliveries, which the replica that ends a job writes, so
an older replica would leave them out), one of a newer version is refused.

PostgreSQL may go away (a restart, a failover): every statement then raises `DatabaseUnavailable` within seconds
(a pool checkout waits at most ACQUIRE_S), which the HTTP app answers with a 503 and the worker waits out. The pool
reconnects by itself with backoff; the first failure and the return are each logged once, not once per request. At
start-up the server waits up to --queue-wait seconds for the database, saying so every LOG_EVERY_S.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from ..errors import UserError
from ..files import private_dir, private_file

SCHEMA_VERSION = 3  # 2: tenants; 3: webhook endpoints and their deliveries (written when a job ends)
_ADVISORY_LOCK = 0x77616E61  # "wana": the lock exclusive transactions and the schema creation take
ACQUIRE_S = 3.0  # the longest a statement waits for a connection before the database counts as away
ACQUIRE_DOWN_S = 0.5  # the same once it is known away: requests get their 503 at once (the pool reconnects meanwhile)
LOG_EVERY_S = 10.0  # while waiting for the database at start-up: one line this often
RECONNECT_S = 10.0  # a pool reconnection gives up after this long; the next statement starts another
DEFAULT_WAIT_S = 120.0  # --queue-wait: how long a server waits for its database at start-up
log = logging.getLogger("runtime")


class DatabaseUnavailable(Exception):
    """The job database cannot be reached now (PostgreSQL restarting, the network cut): try again in a few seconds.
    The HTTP app answers 503 with Retry-After; the worker waits it out."""

_COLUMNS_DDL = """
    id TEXT PRIMARY KEY,
    seq BIGINT NOT NULL,                  -- creation order (created_at is whole seconds)
    created_at BIGINT NOT NULL,
    completed_at BIGINT,
    status TEXT NOT NULL,                 -- queued | in_progress | completed | failed
    progress INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,  -- claims so far; writes are fenced by (id, owner, attempts)
    model TEXT NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    prompt TEXT NOT NULL,
    params TEXT NOT NULL,                 -- JSON: the generation settings
    image TEXT,                           -- storage keys of the input images, JSON list
    error_code TEXT,
    error_message TEXT,
    owner TEXT,                           -- the replica that claimed it (runtime/serve/jobs.py replica_id)
    heartbeat DOUBLE PRECISION NOT NULL DEFAULT 0,  -- seconds since the epoch, the database's clock
    video TEXT,                           -- storage key of the finished video
    tenant TEXT NOT NULL DEFAULT 'default',  -- the name of the tenant whose key created it (runtime/serve/tenants.py)
    lora_passed INTEGER NOT NULL DEFAULT 0  -- times a replica took a job behind it for its LoRA set (jobs.py claim)
"""
_SCHEMA = [
    f"CREATE TABLE IF NOT EXISTS jobs ({_COLUMNS_DDL})",
    "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq)",
    "CREATE TABLE IF NOT EXISTS wan_aot_schema (version INTEGER NOT NULL)",
    # when a job of each tenant was last claimed (the database's clock): whose turn it is next (jobs.py)
    "CREATE TABLE IF NOT EXISTS wan_aot_tenants (name TEXT PRIMARY KEY, served DOUBLE PRECISION NOT NULL)",
    # each tenant's webhook endpoints, and the deliveries of job events to them, kept until a 2xx (webhooks.py)
    """CREATE TABLE IF NOT EXISTS wan_aot_webhook_endpoints (
        id TEXT PRIMARY KEY, seq BIGINT NOT NULL, tenant TEXT NOT NULL, name TEXT NOT NULL, url TEXT NOT NULL,
        event_types TEXT NOT NULL,            -- JSON list
        secret TEXT NOT NULL,                 -- whsec_..., signs the deliveries (Standard Webhooks)
        old_secret TEXT, old_secret_until DOUBLE PRECISION,  -- rotate_secret keeping the old one for a while
        created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS wan_aot_endpoints_by_tenant ON wan_aot_webhook_endpoints (tenant, seq)",
    """CREATE TABLE IF NOT EXISTS wan_aot_webhook_deliveries (
        id TEXT PRIMARY KEY,                  -- the webhook-id header: the same on every attempt
        endpoint TEXT NOT NULL,               -- an endpoint's id, or 'server' (--webhook-url, whose url is here)
        url TEXT,
        payload TEXT NOT NULL,                -- the event, as sent
        created_at DOUBLE PRECISION NOT NULL, next_attempt DOUBLE PRECISION NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        state TEXT NOT NULL DEFAULT 'pending',  -- pending | delivered | failed (out of time) | dropped (no endpoint)
        locked_until DOUBLE PRECISION NOT NULL DEFAULT 0,  -- a replica is sending it until then
        last_error TEXT, done_at DOUBLE PRECISION)""",
    "CREATE INDEX IF NOT EXISTS wan_aot_deliveries_due ON wan_aot_webhook_deliveries (state, next_attempt)",
]
# Columns added since version 1, and what needs them: every start adds those missing (whatever the version row says).
# `lora_passed` (LoRA affinity, runtime/serve/loras.py) has no version of its own: it came with version 2, and a
# replica that knows nothing of it reads and writes the jobs as before (its claims ignore it).
_ADDED = (("tenant", "TEXT NOT NULL DEFAULT 'default'"), ("lora_passed", "INTEGER NOT NULL DEFAULT 0"))
_AFTER_ADDED = ["CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, seq)"]


class Tx(Protocol):
    def one(self, sql: str, args: tuple = ()) -> tuple | None: ...
    def all(self, sql: str, args: tuple = ()) -> list[tuple]: ...
    def execute(self, sql: str, args: tuple = ()) -> int: ...  # rows changed


class Database(Protocol):
    now: str  # SQL: the database's clock, seconds since the epoch (float)
    now_int: str  # the same, whole seconds
    skip_locked: str  # appended to the claim's SELECT

    up: bool  # whether the last statement reached the database
    errors: int  # statements that found it unreachable, since the start

    def transaction(self, exclusive: bool) -> contextlib.AbstractContextManager[Tx]: ...
    def ping(self) -> bool: ...
    def close(self) -> None: ...


def open_database(url: str | None, jobs_dir: Path, wait: float = DEFAULT_WAIT_S) -> Database:
    """`url` None (or sqlite:///PATH): SQLite at jobs_dir/jobs.sqlite3 (or PATH); postgresql://...: PostgreSQL,
    waited for up to `wait` seconds if it cannot be reached yet."""
    if url is None or url.startswith("sqlite:"):
        path = Path(url[len("sqlite://"):]) if url and url.startswith("sqlite://") else jobs_dir / "jobs.sqlite3"
        return SQLite(path)
    if url.startswith(("postgresql://", "postgres://")):
        return Postgres(url, wait)
    raise UserError(f"--queue {url!r} is not a postgresql:// URL (or sqlite:///PATH); leave it out for SQLite "
                    "under --jobs-dir")


def _check_version(version: int | None, where: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise UserError(f"the job database at {where} has schema version {version}, newer than this wan-aot reads "
                        f"({SCHEMA_VERSION}): upgrade every replica")


def _stamp_version(tx: Any, version: int | None) -> None:
    """Record SCHEMA_VERSION once the schema is upgraded to it (after the columns were added)."""
    if version is None:
        tx.execute("INSERT INTO wan_aot_schema (version) VALUES (?)", (SCHEMA_VERSION,))
    elif version < SCHEMA_VERSION:
        tx.execute("UPDATE wan_aot_schema SET version = ?", (SCHEMA_VERSION,))


# -- SQLite ----------------------------------------------------------------------------------------------
class _SQLiteTx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def one(self, sql: str, args: tuple = ()) -> tuple | None:
        return self.db.execute(sql, args).fetchone()

    def all(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self.db.execute(sql, args).fetchall()

    def execute(self, sql: str, args: tuple = ()) -> int:
        return self.db.execute(sql, args).rowcount


class SQLite:
    """One connection (WAL, synchronous=FULL), serialized by a lock: a single server's queue. Its directory is made
    0700 and the database 0600 (the prompts are in it)."""

    now = "((julianday('now') - 2440587.5) * 86400.0)"
    now_int = "CAST(strftime('%s', 'now') AS INTEGER)"
    skip_locked = ""
    up = True  # a file: there while the process is
    errors = 0

    def __init__(self, path: Path) -> None:
        private_dir(path.parent)
        self.path = private_file(path)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._lock = threading.Lock()
        with self.transaction(exclusive=True) as tx:
            for statement in _SCHEMA:
                tx.execute(statement)
            self._upgrade(tx)

    def _upgrade(self, tx: _SQLiteTx) -> None:
        """Job databases written before the lease columns existed: add them (the old videos kept their names); and
        those before tenants (version 1): their jobs are the default tenant's."""
        row = tx.one("SELECT MAX(version) FROM wan_aot_schema")
        version = row[0] if row else None
        _check_version(version, str(self.path))
        have = {row[1] for row in tx.all("PRAGMA table_info(jobs)")}
        for column, ddl in (("owner", "TEXT"), ("heartbeat", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
                            ("video", "TEXT"), *_ADDED):
            if column not in have:
                tx.execute(f"ALTER TABLE jobs ADD COLUMN {column} {ddl}")
                if column == "video":
                    tx.execute("UPDATE jobs SET video = 'videos/' || id || '.mp4' WHERE status = 'completed'")
        for statement in _AFTER_ADDED:
            tx.execute(statement)
        _stamp_version(tx, version)

    @contextlib.contextmanager
    def transaction(self, exclusive: bool) -> Iterator[_SQLiteTx]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE" if exclusive else "BEGIN")
            try:
                yield _SQLiteTx(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        with self._lock:
            self._db.close()


# -- PostgreSQL ----------------------------------------------------------------------------------------------
class _PostgresTx:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    @staticmethod
    def _sql(sql: str) -> str:
        return sql.replace("?", "%s")

    def one(self, sql: str, args: tuple = ()) -> tuple | None:
        return self.conn.execute(self._sql(sql), args).fetchone()

    def all(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self.conn.execute(self._sql(sql), args).fetchall()

    def execute(self, sql: str, args: tuple = ()) -> int:
        return self.conn.execute(self._sql(sql), args).rowcount


class Postgres:
    """A psycopg 3 connection pool; every replica pointing at the same database serves one queue. Connections are
    checked before use (one that a restart closed is replaced, not handed out), and a statement that cannot get one
    within ACQUIRE_S, or loses it, raises DatabaseUnavailable."""

    now = "extract(epoch from clock_timestamp())::double precision"
    now_int = "CAST(extract(epoch from clock_timestamp()) AS BIGINT)"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, wait: float = DEFAULT_WAIT_S) -> None:
        try:
            from psycopg_pool import ConnectionPool
        except ImportError:
            raise UserError("--queue postgresql://... needs psycopg: pip install 'wan-aot[postgres]'") from None
        import psycopg
        from psycopg_pool import PoolTimeout

        self.url = url
        self.up, self.errors = False, 0  # up once the schema is there
        self._down_since: float | None = None  # None: not yet connected (start-up logs its own lines)
        self._state = threading.Lock()
        self._unreachable = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)
        # reconnect_timeout: the pool's reconnection backoff doubles without bound; giving up after RECONNECT_S lets
        # the next statement start a fresh attempt (from 1 s), so a database back after minutes is seen in seconds.
        self.pool = ConnectionPool(url, min_size=1, max_size=8, open=False, check=ConnectionPool.check_connection,
                                   reconnect_timeout=RECONNECT_S, kwargs={"autocommit": True, "connect_timeout": 5})
        logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # one line per attempt: ours say it once
        self._create(wait)

    def _create(self, wait: float) -> None:
        """The schema, once the database answers: waited for up to `wait` seconds, logging every LOG_EVERY_S. A
        database that answers with a refusal (a wrong password, no such database) is not waited for."""
        import psycopg

        t0, said = time.monotonic(), None
        while True:
            try:
                if self.pool.closed:
                    try:
                        psycopg.connect(self.url, connect_timeout=5).close()
                    except psycopg.OperationalError as e:
                        if not _transient(e):
                            raise UserError(f"cannot connect to the job database {_redact(self.url)}: "
                                            f"{_first_line(e)}") from None
                        raise DatabaseUnavailable(_first_line(e)) from e
                    self.pool.open(wait=True, timeout=10)
                with self.transaction(exclusive=True) as tx:  # under the lock: replicas starting at once take turns
                    for statement in _SCHEMA:
                        tx.execute(statement)
                    row = tx.one("SELECT MAX(version) FROM wan_aot_schema")
                    version = row[0] if row else None
                    _check_version(version, _redact(self.url))
                    for column, ddl in _ADDED:
                        tx.execute(f"ALTER TABLE jobs ADD COLUMN IF NOT EXISTS {column} {ddl}")
                    for statement in _AFTER_ADDED:
                        tx.execute(statement)
                    _stamp_version(tx, version)
                return
            except (DatabaseUnavailable, *self._unreachable) as e:
                waited = time.monotonic() - t0
                if waited >= wait:
                    self.pool.close()
                    raise UserError(f"cannot connect to the job database {_redact(self.url)} after {waited:.0f} s "
                                    f"({_first_line(e.__cause__ or e)}); start it, or give it longer with "
                                    "--queue-wait SECONDS") from None
                if said is None or time.monotonic() - said >= LOG_EVERY_S:
                    log.warning("waiting for the job database %s (%.0f s of --queue-wait %.0f): %s",
                                _redact(self.url), waited, wait, _first_line(e.__cause__ or e))
                    said = time.monotonic()
                time.sleep(min(1.0, max(0.0, wait - waited)))
            except BaseException:
                self.pool.close()
                raise

    @contextlib.contextmanager
    def transaction(self, exclusive: bool) -> Iterator[_PostgresTx]:
        try:
            with self.pool.connection(timeout=ACQUIRE_S if self.up else ACQUIRE_DOWN_S) as conn, conn.transaction():
                if exclusive:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK,))
                yield _PostgresTx(conn)
        except self._unreachable as e:
            self._went(False, e)
            raise DatabaseUnavailable(f"the job database is unreachable: {_first_line(e)}") from e
        self._went(True)

    def _went(self, up: bool, error: BaseException | None = None) -> None:
        """Count a failure; log the first one and the return, once each."""
        with self._state:
            if not up:
                self.errors += 1
            if up == self.up:
                return
            self.up = up
            if not up:
                self._down_since = time.monotonic()
                log.error("the job database %s is unreachable (%s): API requests get 503 and the worker waits until "
                          "it returns; reconnecting", _redact(self.url), _first_line(error))
            elif self._down_since is not None:
                log.warning("the job database %s is back after %.1f s", _redact(self.url),
                            time.monotonic() - self._down_since)
            else:
                log.info("connected to the job database %s", _redact(self.url))

    def ping(self) -> bool:
        try:
            with self.transaction(exclusive=False) as tx:
                tx.one("SELECT 1")
            return True
        except DatabaseUnavailable:
            return False

    def close(self) -> None:
        self.pool.close()


def _transient(e: Any) -> bool:
    """A connection error worth waiting out: no answer at all (refused, timed out), or the server saying it is starting,
    stopping, in recovery or full (SQLSTATE 08, 57P, 53300); not a refusal such as a wrong password or no such
    database. libpq's connection errors carry no SQLSTATE: those are told by the server's FATAL message."""
    state = getattr(e, "sqlstate", None)
    if state is not None:
        return state.startswith(("08", "57P", "53300"))
    text = str(e)
    return "FATAL:" not in text or any(why in text for why in _WAIT_FOR)


_WAIT_FOR = ("starting up", "shutting down", "in recovery", "not yet accepting connections", "too many clients")


def _first_line(e: BaseException | None) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _redact(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
