"""Atomic output: write to a temporary name in the same directory, rename when complete."""

from __future__ import annotations

import contextlib
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
