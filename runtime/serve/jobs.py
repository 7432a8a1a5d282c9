"""The job queue every replica of a deployment shares: jobs in a database (SQLite or PostgreSQL, runtime/serve/db.py),
claimed under a lease, every write after the claim fenced by (job, owner, attempt).

A replica claims a job in progress under a lease that ran out (its owner stopped heartbeating: it died, hangs, or was
cut off), else a queued one, in one short transaction that marks it taken by this replica, counts the attempt and
stamps the heartbeat (serialized with every other claim and insert: the database's exclusive lock). Queued jobs are
taken in turns between the tenants that have some (runtime/serve/tenants.py): the tenant served longest ago (each
claim stamps its tenant's turn, in a table of their own, so deleting jobs does not move a tenant up) goes next,
with its oldest job; so a tenant that queues a hundred jobs delays another's by one job, not a hundred.

While the job makes progress its replica heartbeats it (runtime/serve/lease.py). Progress, completion and failure
are written only `WHERE id = ? AND owner = ? AND attempts = ?`: a replica that was presumed
dead and comes back finds its writes refused (`Lost`) and can never overwrite the job's new owner. A job claimed
MAX_ATTEMPTS times without finishing fails with code `attempts_exhausted` and a message saying why, instead of
being claimed again. Every state change is one committed transaction, so a replica killed at any point leaves each
accepted job queued, in progress (until its lease runs out), completed or failed: never lost, never half-written.

A client may cancel a job (`cancel`: it stays, failed with code `cancelled`) or delete it (`delete`) at any time, also
while it runs: either is one write that takes the job out of progress, so the owner's next fenced write (its progress
after the step in flight, or its heartbeat) finds it gone, and `cancelled` tells the owner to stop rather than think
itself taken over; a cancelled job is never claimed again, lease or not.

A job's end (completed or failed, cancellations included) is also an event for the tenant's webhook endpoints
(runtime/serve/webhooks.py): `events` writes the deliveries in the same transaction as the end, so none is lost.

Times are the database's clock (one clock for every replica); videos and images live in a Storage
(runtime/serve/storage.py) under keys recorded on the job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .. import hls
from ..files import process_alive
from .db import Database
from .storage import Storage, StorageUnavailable
from .tenants import DEFAULT_TENANT

log = logging.getLogger("runtime")

MAX_ATTEMPTS = 2  # a job whose replica died twice while running it is failed, not retried forever
DEFAULT_LEASE_S = 60.0  # a job's heartbeat older than this: any replica may take it over
STATUSES = ("queued", "in_progress", "completed", "failed")


@dataclass
class Job:
    id: str
    seq: int
    created_at: int
    status: str
    model: str
    size: str
    seconds: str
    prompt: str
    params: dict[str, Any]
    images: list[str] = field(default_factory=list)  # storage keys of the input images
    progress: int = 0
    attempts: int = 0
    completed_at: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    owner: str | None = None  # the replica running it (in_progress), or that finished it
    video: str | None = None  # storage key of the video (completed)
    tenant: str = DEFAULT_TENANT  # the tenant whose key created it: only that tenant sees it

    def to_api(self) -> dict[str, Any]:
        """The OpenAI video object."""
        out: dict[str, Any] = {"id": self.id, "object": "video", "created_at": self.created_at,
                               "completed_at": self.completed_at, "status": self.status, "model": self.model,
                               "progress": self.progress, "size": self.size, "seconds": self.seconds,
                               "prompt": self.prompt, "error": None,
                               "remixed_from_video_id": self.params.get("remixed_from_video_id")}
        if self.status == "failed":
            out["error"] = {"code": self.error_code or "generation_failed", "message": self.error_message or ""}
        return out


class QueueFull(Exception):
    """No room: `waiting` jobs wait, `limit` may (`mine`: the limit of one tenant, not the whole queue's)."""

    def __init__(self, waiting: int, limit: int, mine: bool = False) -> None:
        super().__init__(waiting)
        self.waiting, self.limit, self.mine = waiting, limit, mine


class Lost(Exception):
    """This replica no longer owns the job (its lease ran out and another replica took it over, or it was
    deleted): its result must not be recorded."""


class NotCancellable(Exception):
    """The job has ended already (`status`: completed or failed): there is nothing to cancel."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


class Events(Protocol):
    """Where a job's end goes besides its row: the webhook deliveries of its tenant (runtime/serve/webhooks.py),
    written in the transaction that ends the job."""

    def job_ended(self, tx: Any, tenant: str, video_id: str, event_type: str) -> None: ...


CANCELLED = "cancelled"  # the error code of a job a client cancelled (POST /v1/videos/{id}/cancel)


def replica_id() -> str:
    """This process's owner name: host, pid and a random part (a restarted process never reuses one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


_COLUMNS = ("id, seq, created_at, status, model, size, seconds, prompt, params, image, progress, attempts, "
            "completed_at, error_code, error_message, owner, video, tenant")


class JobStore:
    """The queue over one Database and one Storage; safe to use from several threads and several replicas."""

    def __init__(self, db: Database, storage: Storage, lease: float = DEFAULT_LEASE_S,
                 owner: str | None = None, max_attempts: int = MAX_ATTEMPTS, events: Events | None = None) -> None:
        self.db, self.storage, self.lease = db, storage, float(lease)
        self.owner = owner or replica_id()
        self.max_attempts = max_attempts
        self.events = events  # the webhooks' deliveries of a job's end (set by the server), or None

    def close(self) -> None:
        self.db.close()

    # -- writes -------------------------------------------------------------
    def add(self, *, model: str, size: str, seconds: str, prompt: str, params: dict[str, Any],
            images: list[bytes], queue_size: int, tenant: str = DEFAULT_TENANT,
            tenant_queue_size: int | None = None) -> Job:
        """Accept a job (and its images) for `tenant`, unless `queue_size` jobs are already waiting in the shared
        queue, or `tenant_queue_size` of this tenant's."""
        job_id = "video_" + secrets.token_hex(12)
        keys = [f"images/{job_id}-{i}.img" for i in range(len(images))]
        for key, data in zip(keys, images):  # stored first: a claimed job always finds its images
            self.storage.put(key, data, retry=False)  # a client's request is not held while a store fails: a 503
        try:
            with self.db.transaction(exclusive=True) as tx:  # the depth check and the insert as one
                _check_room(tx, tenant, queue_size, tenant_queue_size)
                seq = tx.one("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs")[0]
                tx.execute("INSERT INTO jobs (id, seq, created_at, status, model, size, seconds, prompt, params, "
                           f"image, heartbeat, tenant) VALUES (?, ?, {self.db.now_int}, 'queued', ?, ?, ?, ?, ?, ?, 0, "
                           "?)", (job_id, seq, model, size, seconds, prompt, json.dumps(params, sort_keys=True),
                                  json.dumps(keys), tenant))
        except BaseException:
            for key in keys:
                with contextlib.suppress(Exception):  # (the storage failing too: orphans, never a job's)
                    self.storage.delete(key)
            raise
        return self.get(job_id)  # type: ignore[return-value]

    def room(self, tenant: str, queue_size: int, tenant_queue_size: int | None = None) -> None:
        """QueueFull unless `add` would take a job of `tenant` now: asked before a request's body is read and its
        media decoded, so a full queue costs a client's upload nothing (`add` checks again, atomically)."""
        with self.db.transaction(exclusive=False) as tx:
            _check_room(tx, tenant, queue_size, tenant_queue_size)

    def claim(self, prefer: str | None = None, passes: int = 0) -> Job | None:
        """The next job, now this replica's (attempt counted, heartbeat stamped, its tenant's turn taken), or None:
        one whose lease ran out first (the oldest), then the oldest queued job of the tenant served longest ago. A job
        out of attempts is failed on the way (`attempts_exhausted`).

        `prefer`: the LoRA set this replica's weights hold (runtime/serve/loras.py set_key). Of the queued jobs, in
        that same order, it takes the first of that set instead, so that it need not switch, unless a job ahead of it
        was passed over `passes` times already: no job waits for more than `passes` others because of a set."""
        while True:
            with self.db.transaction(exclusive=True) as tx:  # one claim at a time: each sees the turns before it
                row = tx.one(f"SELECT id, status, attempts, owner, tenant FROM jobs AS j WHERE status = 'queued' OR "
                             f"(status = 'in_progress' AND heartbeat < {self.db.now} - ?) "
                             "ORDER BY CASE WHEN status = 'queued' THEN 1 ELSE 0 END, "
                             "COALESCE((SELECT served FROM wan_aot_tenants WHERE name = j.tenant), 0), seq "
                             f"LIMIT 1{self.db.skip_locked}", (self.lease,))
                if row is None:
                    return None
                job_id, status, attempts, owner, tenant = row
                if status == "queued" and prefer is not None and passes > 0:
                    job_id, tenant = self._prefer(tx, prefer, passes)
                if status == "in_progress" and attempts >= self.max_attempts:
                    tx.execute(f"UPDATE jobs SET status = 'failed', completed_at = {self.db.now_int}, "
                               "error_code = 'attempts_exhausted', error_message = ? WHERE id = ?",
                               (f"the replica running this job stopped (it died, hung or lost the database) "
                                f"{attempts} times; it was not tried again: submit it anew", job_id))
                    self._ended(tx, tenant, job_id, "failed")
                    failed = job_id
                else:
                    tx.execute(f"UPDATE jobs SET status = 'in_progress', owner = ?, heartbeat = {self.db.now}, "
                               "attempts = attempts + 1, progress = 0 WHERE id = ?", (self.owner, job_id))
                    tx.execute(f"INSERT INTO wan_aot_tenants (name, served) VALUES (?, {self.db.now}) "
                               "ON CONFLICT (name) DO UPDATE SET served = excluded.served", (tenant,))
                    failed = None
            if failed is None:
                return self.get(job_id)
            self._drop_images(self.get(failed))

    def heartbeat(self, job: Job) -> bool:
        """Renew this replica's lease on `job`; False if it is no longer ours."""
        return self._fenced(job, f"heartbeat = {self.db.now}", ())

    def set_progress(self, job: Job, progress: int) -> None:
        if not self._fenced(job, f"progress = ?, heartbeat = {self.db.now}", (progress,)):
            raise Lost(job.id)

    def complete(self, job: Job, video: str, also: tuple[str, ...] = ()) -> None:
        """Record `job` completed with the video stored under `video` (and the files derived from it, `also`: its
        thumbnail and spritesheet); Lost if it is no longer ours (they are then removed: the job's new owner writes
        its own)."""
        if not self._fenced(job, f"status = 'completed', progress = 100, completed_at = {self.db.now_int}, video = ?",
                            (video,), event="completed"):
            self.discard(video, *also)
            raise Lost(job.id)
        self._drop_images(job)
        self.discard(self.preview_key(job))

    def fail(self, job: Job, code: str, message: str) -> None:
        if not self._fenced(job, f"status = 'failed', completed_at = {self.db.now_int}, error_code = ?, "
                                 "error_message = ?", (code, message), event="failed"):
            raise Lost(job.id)
        self._drop_images(job)
        self.discard(self.preview_key(job))

    def cancel(self, job_id: str, tenant: str | None = None, message: str | None = None) -> Job | None:
        """Cancel a queued or running job, keeping it: failed, with code `cancelled` (one write: it is never claimed
        again, and its owner's next fenced write, after the step in flight, finds it no longer in progress). Returns
        the job, None if unknown (or not `tenant`'s); NotCancellable if it has ended already. `message`: why, where
        the server cancels it itself (an image edit's request gone or past its bound: runtime/serve/images.py)."""
        where, args = ("id = ?", (job_id,)) if tenant is None else ("id = ? AND tenant = ?", (job_id, tenant))
        with self.db.transaction(exclusive=False) as tx:
            n = tx.execute(f"UPDATE jobs SET status = 'failed', completed_at = {self.db.now_int}, error_code = ?, "
                           f"error_message = ? WHERE {where} AND status IN ('queued', 'in_progress')",
                           (CANCELLED, message or "cancelled by the client (POST /v1/videos/{id}/cancel)", *args))
            if n:
                row = tx.one("SELECT tenant FROM jobs WHERE id = ?", (job_id,))
                self._ended(tx, row[0], job_id, "failed")
        job = self.get(job_id, tenant)
        if job is None:
            return None
        if not n:
            raise NotCancellable(job.status)
        self._drop_images(job)
        self.discard(self.preview_key(job))
        return job

    def cancelled(self, job: Job) -> bool:
        """Whether `job`, which this replica ran, was cancelled or deleted by a client (rather than taken over)."""
        now = self.get(job.id)
        return now is None or (now.status == "failed" and now.error_code == CANCELLED and now.attempts == job.attempts)

    def release(self, job: Job) -> None:
        """Give an unfinished job back to the queue at once (its attempt stays counted)."""
        self._fenced(job, "status = 'queued', progress = 0, owner = NULL, heartbeat = 0", ())

    def expire_dead_local_owners(self) -> list[Job]:
        """Jobs in progress under an owner that ran on this host and whose process is gone (this replica's own
        previous run, after a crash): their lease is ended now rather than after it runs out, so a restarted
        single server takes them up at once. Returns them."""
        host = socket.gethostname()
        with self.db.transaction(exclusive=False) as tx:
            rows = tx.all("SELECT id, owner FROM jobs WHERE status = 'in_progress' AND owner LIKE ?", (f"{host}:%",))
        expired = []
        for job_id, owner in rows:
            _, pid, _ = owner.rsplit(":", 2)
            if owner != self.owner and not _alive(int(pid)):
                with self.db.transaction(exclusive=False) as tx:
                    tx.execute("UPDATE jobs SET heartbeat = 0 WHERE id = ? AND owner = ? AND status = 'in_progress'",
                               (job_id, owner))
                expired.append(job_id)
        return [j for j in map(self.get, expired) if j is not None]

    def delete(self, job_id: str, tenant: str | None = None) -> Job | None:
        """Remove a job (its video, the files derived from it and its images too), also one queued (it never runs)
        or running (its owner stops after the step in flight, storing nothing); returns it, or None if unknown (or
        not `tenant`'s, where given)."""
        job = self.get(job_id, tenant)
        if job is None:
            return None
        with self.db.transaction(exclusive=False) as tx:
            n = tx.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        if n == 0:
            return None
        if job.video:
            self.discard(job.video, *derived_keys(job.video))
        self._drop_images(job)
        self.discard(self.preview_key(job))
        self._drop_streams(job)
        return job

    # -- reads --------------------------------------------------------------
    def get(self, job_id: str, tenant: str | None = None) -> Job | None:
        """The job, or None if unknown, or (where `tenant` is given) another tenant's: to a tenant, the jobs of
        others do not exist."""
        where, args = ("id = ?", (job_id,)) if tenant is None else ("id = ? AND tenant = ?", (job_id, tenant))
        with self.db.transaction(exclusive=False) as tx:
            row = tx.one(f"SELECT {_COLUMNS} FROM jobs WHERE {where}", args)
        return None if row is None else _job(row)

    def list(self, limit: int, after: str | None = None, order: str = "desc",
             tenant: str | None = None) -> tuple[list[Job], bool]:
        """Jobs newest first (or oldest first), starting after the job `after`, `tenant`'s only where given;
        (page, has_more). KeyError if `after` is not a job (of `tenant`)."""
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        where: list[str] = []
        args: tuple = ()
        if tenant is not None:
            where, args = ["tenant = ?"], (tenant,)
        if after is not None:
            anchor = self.get(after, tenant)
            if anchor is None:
                raise KeyError(after)
            where, args = [*where, f"seq {op} ?"], (*args, anchor.seq)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self.db.transaction(exclusive=False) as tx:
            rows = tx.all(f"SELECT {_COLUMNS} FROM jobs {clause} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1))
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def counts(self) -> dict[str, int]:
        """Jobs by status across every replica (the shared queue)."""
        with self.db.transaction(exclusive=False) as tx:
            rows = tx.all("SELECT status, COUNT(*) FROM jobs GROUP BY status")
        return {s: 0 for s in STATUSES} | {s: int(n) for s, n in rows}

    def tenant_counts(self) -> dict[str, dict[str, int]]:
        """Jobs by tenant name, then status, across every replica."""
        with self.db.transaction(exclusive=False) as tx:
            rows = tx.all("SELECT tenant, status, COUNT(*) FROM jobs GROUP BY tenant, status")
        out: dict[str, dict[str, int]] = {}
        for tenant, status, n in rows:
            out.setdefault(tenant, {s: 0 for s in STATUSES})[status] = int(n)
        return out

    def video_key(self, job: Job) -> str:
        """Where this attempt's video goes: one key per attempt, so a stale owner never overwrites the file of
        the job's current owner. An image edit's (runtime/serve/images.py) is its PNG."""
        ext = "png" if job.params.get("task") == "image_edit" else "mp4"
        return f"videos/{job.id}-{job.attempts}.{ext}"

    def stream_key(self, job: Job, name: str, attempt: int | None = None) -> str:
        """Where file `name` of an attempt's live stream goes (runtime/hls.py's names: "stream.m3u8", "stream/<n>.ts"),
        flat beside the other attempts' (default: the job's current attempt)."""
        base = f"streams/{job.id}-{job.attempts if attempt is None else attempt}"
        return f"{base}.m3u8" if name == hls.PLAYLIST else f"{base}-{hls.segment_index(name)}.ts"

    def _drop_streams(self, job: Job) -> None:
        """Every attempt's stream: the segments its playlist names, then the playlist."""
        for attempt in range(1, job.attempts + 1):
            key = self.stream_key(job, hls.PLAYLIST, attempt)
            try:
                playlist = hls.Playlist.parse(self.storage.read(key).decode())
            except (OSError, ValueError, StorageUnavailable):
                continue
            self.discard(*(self.stream_key(job, hls.segment_name(n), attempt)
                            for n in range(len(playlist.durations))), key)

    def preview_key(self, job: Job) -> str:
        """Where the running attempt's live preview goes (runtime/serve/thumbnails.py); removed when the job ends."""
        return f"previews/{job.id}-{job.attempts}.png"

    # -- internals ----------------------------------------------------------
    def _prefer(self, tx: Any, prefer: str, passes: int) -> tuple[str, str]:
        """(id, tenant) of the queued job `claim` takes for LoRA set `prefer` (loras.pick), the jobs before it in the
        tenants' turns each counted as passed over once; in the claim's transaction."""
        from .loras import pick, set_key

        rows = _turns(tx.all("SELECT id, tenant, params, lora_passed FROM jobs AS j WHERE status = 'queued' ORDER BY "
                             "COALESCE((SELECT served FROM wan_aot_tenants WHERE name = j.tenant), 0), seq"
                             f"{self.db.skip_locked}"))
        i = pick([(set_key(json.loads(params).get("lora")), int(passed)) for _, _, params, passed in rows], prefer,
                 passes)
        if i > 0:
            ahead = [row[0] for row in rows[:i]]
            tx.execute(f"UPDATE jobs SET lora_passed = lora_passed + 1 WHERE id IN ({', '.join('?' * len(ahead))})",
                       tuple(ahead))
        return rows[i][0], rows[i][1]

    def _fenced(self, job: Job, assignments: str, args: tuple, event: str | None = None) -> bool:
        """The write, if the job is still this attempt's and in progress; with `event`, the job's end, whose
        webhook deliveries are written in the same transaction."""
        with self.db.transaction(exclusive=False) as tx:
            n = tx.execute(f"UPDATE jobs SET {assignments} WHERE id = ? AND owner = ? AND attempts = ? "
                           "AND status = 'in_progress'", (*args, job.id, self.owner, job.attempts))
            if n == 1 and event is not None:
                self._ended(tx, job.tenant, job.id, event)
        return n == 1

    def _ended(self, tx: Any, tenant: str, job_id: str, status: str) -> None:
        if self.events is not None:
            self.events.job_ended(tx, tenant, job_id, f"video.{status}")

    def _drop_images(self, job: Job | None) -> None:
        self.discard(*(job.images if job else []))

    def discard(self, *keys: str) -> None:
        """Remove files the job's record no longer refers to (recorded first): a storage failing now leaves them
        behind, never served, with a line in the log, rather than failing what was recorded."""
        for key in keys:
            try:
                self.storage.delete(key)
            except Exception as e:  # noqa: BLE001  (the object store is away, say)
                log.warning("cannot remove %s, which no job refers to any more: %s: %s", key, type(e).__name__, e)


def derived_keys(video: str) -> tuple[str, str]:
    """The keys of a video's thumbnail (WebP) and spritesheet (JPEG), beside it (runtime/serve/thumbnails.py)."""
    stem = video.rsplit(".", 1)[0]
    return f"{stem}.thumbnail.webp", f"{stem}.spritesheet.jpg"


def open_store(jobs_dir: Path, queue: str | None = None, videos_url: str | None = None,
               lease: float = DEFAULT_LEASE_S, queue_wait: float = 120.0, store_retry: float = 300.0) -> JobStore:
    """The store a server uses: the database at `queue` (None: SQLite under `jobs_dir`; PostgreSQL waited for up to
    `queue_wait` seconds) and the storage at `videos_url` (None: `jobs_dir`; a store's failing writes retried for
    `store_retry` seconds)."""
    from .db import open_database
    from .storage import Directory, open_storage

    storage = open_storage(videos_url, jobs_dir, store_retry)
    if isinstance(storage, Directory) and queue is None:  # one server owns the directory: left by a crash of it
        storage.remove_partials()
    return JobStore(open_database(queue, jobs_dir, queue_wait), storage, lease)


def _turns(rows: list[tuple]) -> list[tuple]:
    """Queued jobs (id, tenant, ...), ordered by their tenant's turn then age, in the order claims would take them if no
    job came in: every tenant's oldest in turn, then every tenant's second, and so on (each claim sends its tenant to
    the back of the turns)."""
    by_tenant: dict[str, list[tuple]] = {}
    for row in rows:
        by_tenant.setdefault(row[1], []).append(row)
    queues = list(by_tenant.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def _check_room(tx: Any, tenant: str, queue_size: int, tenant_queue_size: int | None) -> None:
    waiting, mine = tx.one("SELECT COUNT(*), COALESCE(SUM(CASE WHEN tenant = ? THEN 1 ELSE 0 END), 0) FROM jobs "
                           "WHERE status = 'queued'", (tenant,))
    if waiting >= queue_size:
        raise QueueFull(int(waiting), queue_size)
    if tenant_queue_size is not None and mine >= tenant_queue_size:
        raise QueueFull(int(mine), tenant_queue_size, mine=True)


def _alive(pid: int) -> bool:
    """Whether an owner's process is still there; our own pid under another owner name is a previous run of this
    process's container, so not."""
    return pid != os.getpid() and process_alive(pid)


def _job(row: tuple) -> Job:
    (job_id, seq, created_at, status, model, size, seconds, prompt, params, image, progress, attempts, completed_at,
     error_code, error_message, owner, video, tenant) = row
    return Job(id=job_id, seq=int(seq), created_at=int(created_at), status=status, model=model, size=size,
               seconds=seconds, prompt=prompt, params=json.loads(params),
               images=[k if "/" in k else f"images/{k}" for k in json.loads(image or "[]")],  # older: bare names
               progress=int(progress), attempts=int(attempts),
               completed_at=None if completed_at is None else int(completed_at), error_code=error_code,
               error_message=error_message, owner=owner, video=video, tenant=tenant)


