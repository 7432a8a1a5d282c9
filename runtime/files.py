"""Atomic output: write to a temporary name in the same directory, rename when complete."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import UserError


def check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UserError(f"output {path} is a directory: give a file name")
    if not parent.is_dir():
        raise UserError(f"output directory {parent} does not exist: create it first")
    if not os.access(parent, os.W_OK):
        raise UserError(f"output directory {parent} is not writable")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` (same suffix); rename it to `path` if the block succeeds."""
    check_writable(path)
    tmp = path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner may enter (0700), made if missing (its parents as the umask says): the
    server's jobs directory holds prompts and videos, which other local users have no business reading. One that
    exists already is tightened if this user owns it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        path.chmod(0o700)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty and readable by its owner only (0600) unless it exists (SQLite gives its WAL and shared
    memory files the database file's mode)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_MESSAGES = ("no space left on device", "disk quota exceeded", "database or disk is full")


def disk_full(e: BaseException | None) -> bool:
    """Whether `e` (or an exception it was raised from) says a disk or quota is full: ENOSPC or EDQUOT, or the text of
    one as a child process (ffmpeg) or SQLite reports it."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        if any(m in str(e).lower() for m in FULL_MESSAGES):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False

