"""The server's durable job queue: SQLite (WAL) under the jobs directory, videos as files beside it.

Every state change is one committed transaction, so a process killed at any point
(SIGKILL included) leaves each accepted job queued, in progress, completed or
failed, never half-written. On start, `recover()` puts jobs that were in progress
back in the queue (they run again, from the start) or, after MAX_ATTEMPTS tries,
marks them failed with a message saying why: no accepted job is lost or left
"in_progress" forever. Videos are written under a temporary name and renamed.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_ATTEMPTS = 2  # a job that was running when the server died twice is failed, not retried forever

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,            -- creation order (created_at is whole seconds)
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    status TEXT NOT NULL,            -- queued | in_progress | completed | failed
    progress INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    model TEXT NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    prompt TEXT NOT NULL,
    params TEXT NOT NULL,            -- JSON: the generation settings
    image TEXT,                      -- file names (under images/) of the input images, JSON list
    error_code TEXT,
    error_message TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq);
"""


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
    images: list[str] = field(default_factory=list)
    progress: int = 0
    attempts: int = 0
    completed_at: int | None = None
    error_code: str | None = None
    error_message: str | None = None

    def to_api(self) -> dict[str, Any]:
        """The OpenAI video object."""
        out: dict[str, Any] = {"id": self.id, "object": "video", "created_at": self.created_at,
                               "completed_at": self.completed_at, "status": self.status, "model": self.model,
                               "progress": self.progress, "size": self.size, "seconds": self.seconds,
                               "prompt": self.prompt, "error": None}
        if self.status == "failed":
            out["error"] = {"code": self.error_code or "generation_failed", "message": self.error_message or ""}
        return out


class QueueFull(Exception):
    pass


class JobStore:
    """Thread-safe access to the jobs database (one connection, serialized by a lock)."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.videos = self.dir / "videos"
        self.images = self.dir / "images"
        for d in (self.dir, self.videos, self.images):
            d.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.dir / "jobs.sqlite3"), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes -------------------------------------------------------------
    def add(self, *, model: str, size: str, seconds: str, prompt: str, params: dict[str, Any],
            images: list[bytes], queue_size: int) -> Job:
        """Accept a job (and its images) unless `queue_size` jobs are already waiting."""
        job_id = "video_" + secrets.token_hex(12)
        names = []
        for i, data in enumerate(images):
            name = f"{job_id}-{i}.img"
            tmp = self.images / f".{name}.partial"
            tmp.write_bytes(data)
            tmp.replace(self.images / name)
            names.append(name)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                waiting = self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]
                if waiting >= queue_size:
                    raise QueueFull(waiting)
                seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
                now = int(time.time())
                self._db.execute(
                    "INSERT INTO jobs (id, seq, created_at, status, model, size, seconds, prompt, params, image) "
                    "VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                    (job_id, seq, now, model, size, seconds, prompt, json.dumps(params, sort_keys=True),
                     json.dumps(names)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                for name in names:
                    (self.images / name).unlink(missing_ok=True)
                raise
        return self.get(job_id)  # type: ignore[return-value]

    def claim(self) -> Job | None:
        """The oldest queued job, now in progress (its attempt counted), or None."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT id FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1").fetchone()
            if row is None:
                self._db.execute("COMMIT")
                return None
            self._db.execute("UPDATE jobs SET status = 'in_progress', progress = 0, attempts = attempts + 1 "
                             "WHERE id = ?", (row[0],))
            self._db.execute("COMMIT")
        return self.get(row[0])

    def set_progress(self, job_id: str, progress: int) -> None:
        self._exec("UPDATE jobs SET progress = ? WHERE id = ? AND status = 'in_progress'", (progress, job_id))

    def complete(self, job_id: str) -> None:
        self._exec("UPDATE jobs SET status = 'completed', progress = 100, completed_at = ? WHERE id = ?",
                   (int(time.time()), job_id))
        self._drop_images(job_id)

    def fail(self, job_id: str, code: str, message: str) -> None:
        self._exec("UPDATE jobs SET status = 'failed', completed_at = ?, error_code = ?, error_message = ? "
                   "WHERE id = ?", (int(time.time()), code, message, job_id))
        self._drop_images(job_id)

    def delete(self, job_id: str) -> Job | None:
        """Remove a job that is not running (its video too); returns it, or None if unknown. Raises
        RuntimeError for a job in progress."""
        job = self.get(job_id)
        if job is None:
            return None
        with self._lock:
            cur = self._db.execute("DELETE FROM jobs WHERE id = ? AND status != 'in_progress'", (job_id,))
        if cur.rowcount == 0:
            raise RuntimeError("in progress")
        self.video_path(job_id).unlink(missing_ok=True)
        self._drop_images(job_id, job)
        return job

    def recover(self) -> list[Job]:
        """After a restart: jobs left in progress run again, or fail after MAX_ATTEMPTS; returns them."""
        with self._lock:
            rows = self._db.execute("SELECT id, attempts FROM jobs WHERE status = 'in_progress'").fetchall()
        for job_id, attempts in rows:
            if attempts >= MAX_ATTEMPTS:
                self.fail(job_id, "server_restarted", f"the server stopped while this job ran, {attempts} times; "
                                                      "it was not retried again: submit it anew")
            else:
                self._exec("UPDATE jobs SET status = 'queued', progress = 0 WHERE id = ?", (job_id,))
        for tmp in [*self.videos.glob(".*.partial*"), *self.images.glob(".*.partial")]:
            tmp.unlink(missing_ok=True)  # written by a process that died
        return [j for j in (self.get(r[0]) for r in rows) if j is not None]

    # -- reads --------------------------------------------------------------
    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def list(self, limit: int, after: str | None = None, order: str = "desc") -> tuple[list[Job], bool]:
        """Jobs newest first (or oldest first), starting after the job `after`; (page, has_more)."""
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        where, args = "", []
        if after is not None:
            anchor = self.get(after)
            if anchor is None:
                raise KeyError(after)
            where, args = f"WHERE seq {op} ?", [anchor.seq]
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY seq {direction} LIMIT ?",
                                    (*args, limit + 1)).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        return {s: 0 for s in ("queued", "in_progress", "completed", "failed")} | dict(rows)

    def video_path(self, job_id: str) -> Path:
        return self.videos / f"{job_id}.mp4"

    def image_paths(self, job: Job) -> list[Path]:
        return [self.images / name for name in job.images]

    # -- internals ----------------------------------------------------------
    def _exec(self, sql: str, args: tuple) -> None:
        with self._lock:
            self._db.execute(sql, args)

    def _drop_images(self, job_id: str, job: Job | None = None) -> None:
        job = job or self.get(job_id)
        for path in self.image_paths(job) if job else []:
            path.unlink(missing_ok=True)


_COLUMNS = ("id, seq, created_at, status, model, size, seconds, prompt, params, image, progress, attempts, "
            "completed_at, error_code, error_message")


def _job(row: tuple) -> Job:
    (job_id, seq, created_at, status, model, size, seconds, prompt, params, image, progress, attempts, completed_at,
     error_code, error_message) = row
    return Job(id=job_id, seq=seq, created_at=created_at, status=status, model=model, size=size, seconds=seconds,
               prompt=prompt, params=json.loads(params), images=json.loads(image or "[]"), progress=progress,
               attempts=attempts, completed_at=completed_at, error_code=error_code, error_message=error_message)
