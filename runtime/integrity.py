"""Checking bundle files against the manifest's sha256 without paying for it on every start.

Every file is hashed before its content is used. What changes here is when:

- **Verified stamps.** After a file's hash has matched, its identity (size, mtime, ctime, inode,
  device) is recorded in a stamp for this bundle directory and bundle id. On the next start a file
  whose identity is unchanged is trusted without re-hashing; anything else about it (a rewrite, a
  touch, a copy, a replaced file) changes that identity and the file is hashed again. Stamps live
  in a private per-user directory (`$WAN_AOT_STAMP_DIR`, else `$XDG_CACHE_HOME/wan-aot/verified`)
  and carry an HMAC under a per-user secret key there, so a stamp that is not this runtime's own
  (copied from another machine, written beside a tampered bundle, edited) is ignored. A stamp for
  another bundle id, or another directory, is ignored too. `runtime verify` never reads stamps.
- **In parallel.** Files still to be hashed are hashed in a thread pool (hashlib releases the GIL).
- **While reading.** Weight files are hashed by the reader that places them (runtime/weights.py),
  one pass over the bytes; see `Checker.begin` / `Checker.finish`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import manifest as mf
from .errors import BundleError

log = logging.getLogger("runtime")

STAMP_ENV = "WAN_AOT_STAMP_DIR"
FORMAT = "wan-aot-verified-1"
CHUNK = 8 << 20


def stamp_dir() -> Path:
    """$WAN_AOT_STAMP_DIR, else $XDG_CACHE_HOME/wan-aot/verified, else ~/.cache/wan-aot/verified."""
    if os.environ.get(STAMP_ENV):
        return Path(os.environ[STAMP_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "wan-aot" / "verified"


def sha256_stream(f: Any, h: Any = None) -> Any:
    """Feed the rest of the open binary file `f` into `h` (a new sha256 by default); returns `h`."""
    h = h if h is not None else hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])
    return h


def sha256_files(paths: list[Path], workers: int | None = None) -> list[str]:
    """sha256 of each file, hashed in parallel."""
    workers = workers or min(len(paths), os.cpu_count() or 1) or 1

    def one(p: Path) -> str:
        with open(p, "rb", buffering=0) as f:
            return sha256_stream(f).hexdigest()

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, paths))


def identity(st: os.stat_result) -> dict[str, int]:
    """What a stamp records of a file: any rewrite, touch, copy or replacement changes one of these."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


@dataclass
class Stamp:
    """The files of one bundle directory (at one bundle id) whose sha256 matched, with their identities."""

    path: Path | None  # where it is kept; None when stamps are unusable here
    key: bytes
    bundle: str
    bundle_id: str
    files: dict[str, dict[str, Any]]

    def body(self) -> dict[str, Any]:
        return {"format": FORMAT, "bundle": self.bundle, "bundle_id": self.bundle_id, "files": self.files}

    def mac(self, body: dict[str, Any]) -> str:
        return hmac.new(self.key, mf.canonical_json(body).encode(), hashlib.sha256).hexdigest()


def _key(directory: Path) -> bytes:
    """This user's stamp key (created on first use, atomically, readable by the owner only)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / "key"
    if not path.exists():
        tmp = directory / f".key.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
            os.link(tmp, path)  # fails if another process made one first: theirs is used
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not private to this user")
    key = path.read_bytes()
    if len(key) != 32:
        raise ValueError(f"{path} is not a stamp key")
    return key


def load_stamp(bundle: Path, bundle_id: str) -> Stamp:
    """This bundle's stamp: its verified files if a valid stamp of ours exists, else empty."""
    where = bundle.resolve()
    try:
        directory = stamp_dir()
        key = _key(directory)
    except (OSError, ValueError) as e:
        log.warning("verified stamps disabled (%s): every start hashes the whole bundle; set %s to a private "
                    "writable directory", e, STAMP_ENV)
        return Stamp(None, b"", str(where), bundle_id, {})
    path = directory / (hashlib.sha256(str(where).encode()).hexdigest()[:32] + ".json")
    stamp = Stamp(path, key, str(where), bundle_id, {})
    try:
        data = json.loads(path.read_text())
        body = {k: data[k] for k in ("format", "bundle", "bundle_id", "files")}
        if (hmac.compare_digest(str(data.get("mac", "")), stamp.mac(body)) and body["format"] == FORMAT
                and body["bundle"] == stamp.bundle and body["bundle_id"] == bundle_id
                and isinstance(body["files"], dict)):
            stamp.files = body["files"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no stamp, or not a valid one of ours: everything is hashed
    return stamp


def save_stamp(stamp: Stamp) -> None:
    """Write the stamp atomically (a failure only costs hashing on the next start)."""
    if stamp.path is None:
        return
    body = stamp.body()
    tmp = stamp.path.with_name(f".{stamp.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps({**body, "mac": stamp.mac(body)}))
        os.replace(tmp, stamp.path)
    except OSError as e:
        log.warning("cannot write the verified stamp %s (%s)", stamp.path, e)
        tmp.unlink(missing_ok=True)


class Checker:
    """The integrity state of one opened bundle: which files are trusted, and recording new matches."""

    def __init__(self, bundle: Path, manifest: mf.Manifest, use_stamp: bool = True) -> None:
        self.bundle = bundle
        self.manifest = manifest
        self.stamp = load_stamp(bundle, manifest.bundle_id) if use_stamp else None
        self.hashed: list[str] = []  # the files this checker hashed (the others were trusted by the stamp)
        self._lock = threading.Lock()

    def path(self, ref: mf.FileRef) -> Path:
        path = mf.resolve(self.bundle, ref.file)
        if not path.is_file():
            raise BundleError(f"bundle file {ref.file} is missing: re-copy or re-export the bundle")
        return path

    def trusted(self, ref: mf.FileRef) -> bool:
        """Whether `ref` matched its sha256 earlier and is, by its identity, the same file now."""
        if self.stamp is None:
            return False
        entry = self.stamp.files.get(ref.file)
        if not entry or entry.get("sha256") != ref.sha256:
            return False
        try:
            now = identity(os.stat(self.path(ref)))
        except (OSError, BundleError):
            return False
        return now == {k: entry.get(k) for k in now}

    def begin(self, ref: mf.FileRef, f: Any) -> tuple[Any, dict[str, int]] | None:
        """Before reading `ref` through the open file `f`: None if it is trusted, else (a sha256 to feed every
        byte of the file into, the file's identity now)."""
        if self.trusted(ref):
            return None
        with self._lock:
            self.hashed.append(ref.file)
        return hashlib.sha256(), identity(os.fstat(f.fileno()))

    def finish(self, ref: mf.FileRef, f: Any, started: tuple[Any, dict[str, int]] | None) -> None:
        """After reading: refuse the file if its bytes did not match, else stamp it (if it did not change
        while it was read)."""
        if started is None:
            return
        h, before = started
        if h.hexdigest() != ref.sha256:
            raise BundleError(mismatch_message(ref))
        if identity(os.fstat(f.fileno())) == before:
            self.record({ref.file: {"sha256": ref.sha256, **before}})

    def check(self, refs: list[mf.FileRef]) -> None:
        """Check whole files (programs, tokenizer) now: the untrusted ones hashed in parallel."""
        todo = [r for r in refs if not self.trusted(r)]
        if not todo:
            return
        paths = [self.path(r) for r in todo]
        with self._lock:
            self.hashed += [r.file for r in todo]
        before = [identity(os.stat(p)) for p in paths]
        digests = sha256_files(paths)
        for ref, digest in zip(todo, digests):
            if digest != ref.sha256:
                raise BundleError(mismatch_message(ref))
        self.record({ref.file: {"sha256": ref.sha256, **b} for ref, p, b in zip(todo, paths, before)
                     if identity(os.stat(p)) == b})

    def record(self, entries: dict[str, dict[str, Any]]) -> None:
        if self.stamp is None or not entries:
            return
        with self._lock:
            self.stamp.files.update(entries)
            save_stamp(self.stamp)


def mismatch_message(ref: mf.FileRef) -> str:
    return (f"bundle file {ref.file} does not match its sha256 in the manifest (tampered or truncated): re-copy "
            "or re-export the bundle")
