"""Where videos and uploaded images live: a directory (the jobs directory, which every replica may mount: NFS,
GCS FUSE) or an object store URL (`--videos-url s3://bucket/prefix`, `gs://...`, through fsspec).

Keys are relative paths ("videos/<id>-<attempt>.mp4" and the thumbnail and spritesheet beside it, "images/<id>-<i>.img",
"previews/<id>-<attempt>.png", the live stream's "streams/<id>-<attempt>.m3u8" and "streams/<id>-<attempt>-<n>.ts").
A write is never seen half done:
a directory gets a temporary name then a rename; an object store gets the whole object in one put.

An object store that fails (answers 5xx, cannot be reached) is retried for a job's writes, with backoff, for
`retry` seconds (--store-retry-seconds) before `StorageUnavailable`; a live preview is not waited for, and a read
(a client's download) fails at once with it, which the HTTP app answers with a 503.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from ..errors import UserError
from ..files import private_dir

CHUNK = 1 << 20
SUBDIRS = ("videos", "images", "previews", "streams")
DEFAULT_RETRY_S = 300.0  # --store-retry-seconds
BACKOFF_S = (0.5, 10.0)  # the first wait between tries of a failing store, and the longest (doubling)
log = logging.getLogger("runtime")


class StorageUnavailable(Exception):
    """The object store failed (5xx, unreachable) and went on failing for as long as the call may wait."""


class Storage(Protocol):
    def put(self, key: str, data: bytes, retry: bool = True) -> None: ...
    def writer(self, key: str, suffix: str = "") -> contextlib.AbstractContextManager[Path]: ...
    def read(self, key: str, wait: bool = False) -> bytes: ...
    def chunks(self, key: str) -> Iterator[bytes]: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def local_path(self, key: str) -> Path | None: ...


def open_storage(url: str | None, jobs_dir: Path, retry: float = DEFAULT_RETRY_S) -> Storage:
    """`url` None: the jobs directory; else an fsspec URL (s3://, gs://, file://, ...), whose failing writes are
    retried for `retry` seconds."""
    if url is None:
        return Directory(jobs_dir)
    return ObjectStore(url, retry)


class Directory:
    """Videos and images under a directory only this user may enter (0700), each file 0600."""

    def __init__(self, root: Path) -> None:
        self.root = private_dir(Path(root))
        for sub in SUBDIRS:
            private_dir(self.root / sub)

    def _path(self, key: str) -> Path:
        return self.root / key

    def put(self, key: str, data: bytes, retry: bool = True) -> None:
        with self.writer(key) as tmp:
            tmp.write_bytes(data)

    @contextlib.contextmanager
    def writer(self, key: str, suffix: str = "") -> Iterator[Path]:
        """A temporary path beside the key's (same filesystem); renamed to the key if the block succeeds."""
        final = self._path(key)
        tmp = final.with_name(f".{final.stem}.partial-{os.getpid()}{suffix or final.suffix}")
        try:
            yield tmp
            os.chmod(tmp, 0o600)  # whoever wrote it (the video encoder too), with the umask's mode
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def read(self, key: str, wait: bool = False) -> bytes:
        return self._path(key).read_bytes()

    def chunks(self, key: str) -> Iterator[bytes]:
        with open(self._path(key), "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def remove_partials(self) -> None:
        """Temporary files left by a process that died mid-write."""
        for sub in SUBDIRS:
            for tmp in (self.root / sub).glob(".*.partial*"):
                tmp.unlink(missing_ok=True)


class ObjectStore:
    """An fsspec filesystem under a URL prefix (s3fs for s3://, gcsfs for gs://)."""

    def __init__(self, url: str, retry: float = DEFAULT_RETRY_S) -> None:
        try:
            import fsspec
        except ImportError:
            raise UserError("--videos-url needs fsspec (and s3fs or gcsfs): pip install 'wan-aot[objectstore]'") \
                from None
        import fsspec.config

        # fsspec's settings from the environment (FSSPEC_S3_ENDPOINT_URL=... for an S3-compatible store, ...), read
        # again here: fsspec reads them once, at its import, which a library may have done before they were set.
        fsspec.config.set_conf_env(fsspec.config.conf)
        try:
            self.fs, self.prefix = fsspec.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise UserError(f"--videos-url {url!r}: {e}") from None
        self.prefix = self.prefix.rstrip("/")
        self.url, self.retry = url, retry

    def _path(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _call(self, what: str, fn: Callable[[], object], wait: float = 0.0) -> object:
        """`fn()`; while the store fails (anything but a missing or forbidden object), again with backoff for up to
        `wait` seconds, then StorageUnavailable. The store's client has retried a few times already within each."""
        t0, delay = time.monotonic(), BACKOFF_S[0]
        while True:
            try:
                return fn()
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                raise
            except Exception as e:  # noqa: BLE001  (5xx, connection refused, timeouts: s3fs/botocore/aiohttp's own)
                waited = time.monotonic() - t0
                if waited + delay > wait:
                    raise StorageUnavailable(f"the video store {self.url} failed to {what}"
                                             f"{f' for {waited:.0f} s' if wait else ''}: {type(e).__name__}: {e}"
                                             ) from e
                if waited == 0 or delay >= BACKOFF_S[1]:
                    log.warning("the video store failed to %s (%s: %s); retrying for up to %.0f s (--store-retry-"
                                "seconds)", what, type(e).__name__, e, wait)
                time.sleep(delay)
                delay = min(BACKOFF_S[1], delay * 2)

    def put(self, key: str, data: bytes, retry: bool = True) -> None:
        # one put: the object appears whole or not at all
        self._call(f"store {key}", lambda: self.fs.pipe_file(self._path(key), data), self.retry if retry else 0.0)

    @contextlib.contextmanager
    def writer(self, key: str, suffix: str = "") -> Iterator[Path]:
        """A local temporary file, uploaded to the key if the block succeeds."""
        with tempfile.TemporaryDirectory(prefix="wan-aot-upload-") as d:
            tmp = Path(d) / (Path(key).stem + (suffix or Path(key).suffix))
            yield tmp
            self._call(f"store {key}", lambda: self.fs.put_file(str(tmp), self._path(key)), self.retry)

    def read(self, key: str, wait: bool = False) -> bytes:
        """The object; `wait`: as a job's input, retried as a job's writes are (a client's read is not held)."""
        return self._call(f"read {key}", lambda: self.fs.cat_file(self._path(key)),  # type: ignore[return-value]
                          self.retry if wait else 0.0)

    def chunks(self, key: str) -> Iterator[bytes]:
        """Opened now (a store that is down fails here, before an answer starts), read as iterated."""
        f: Any = self._call(f"read {key}", lambda: self.fs.open(self._path(key), "rb"))

        def read() -> Iterator[bytes]:
            with f:
                while chunk := f.read(CHUNK):
                    yield chunk

        return read()

    def exists(self, key: str) -> bool:
        return bool(self._call(f"look up {key}", lambda: self.fs.exists(self._path(key))))

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(f"delete {key}", lambda: self.fs.rm_file(self._path(key)))

    def local_path(self, key: str) -> Path | None:
        return None
