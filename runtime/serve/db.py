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
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from ..errors import UserError
from ..files import private_dir, private_file

SCHEMA_VERSION = 3  # 2: tenants; 3: webhook endpoints and their deliveries (written when a job ends)
_ADVISORY_LOCK = 0x77616E61  # "wana": the lock exclusive transactions and the schema creation take

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

    def transaction(self, exclusive: bool) -> contextlib.AbstractContextManager[Tx]: ...
    def close(self) -> None: ...


def open_database(url: str | None, jobs_dir: Path) -> Database:
    """`url` None (or sqlite:///PATH): SQLite at jobs_dir/jobs.sqlite3 (or PATH); postgresql://...: PostgreSQL."""
    if url is None or url.startswith("sqlite:"):
        path = Path(url[len("sqlite://"):]) if url and url.startswith("sqlite://") else jobs_dir / "jobs.sqlite3"
        return SQLite(path)
    if url.startswith(("postgresql://", "postgres://")):
        return Postgres(url)
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
    """A psycopg 3 connection pool; every replica pointing at the same database serves one queue."""

    now = "extract(epoch from clock_timestamp())::double precision"
    now_int = "CAST(extract(epoch from clock_timestamp()) AS BIGINT)"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, connect_timeout: float = 10.0) -> None:
        try:
            from psycopg_pool import ConnectionPool
        except ImportError:
            raise UserError("--queue postgresql://... needs psycopg: pip install 'wan-aot[postgres]'") from None
        import psycopg

        self.url = url
        self.pool = ConnectionPool(url, min_size=1, max_size=8, open=False, kwargs={"autocommit": True})
        try:
            self.pool.open(wait=True, timeout=connect_timeout)
        except (psycopg.Error, Exception) as e:  # noqa: BLE001  (psycopg_pool.PoolTimeout and friends)
            self.pool.close()
            raise UserError(f"cannot connect to the job database {_redact(url)} ({type(e).__name__}: {e})") from None
        with self.transaction(exclusive=True) as tx:  # under the lock: replicas starting at once take turns
            for statement in _SCHEMA:
                tx.execute(statement)
            row = tx.one("SELECT MAX(version) FROM wan_aot_schema")
            version = row[0] if row else None
            _check_version(version, _redact(url))
            for column, ddl in _ADDED:
                tx.execute(f"ALTER TABLE jobs ADD COLUMN IF NOT EXISTS {column} {ddl}")
            for statement in _AFTER_ADDED:
                tx.execute(statement)
            _stamp_version(tx, version)

    @contextlib.contextmanager
    def transaction(self, exclusive: bool) -> Iterator[_PostgresTx]:
        with self.pool.connection() as conn, conn.transaction():
            if exclusive:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK,))
            yield _PostgresTx(conn)

    def close(self) -> None:
        self.pool.close()


def _redact(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
