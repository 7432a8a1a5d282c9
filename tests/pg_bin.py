"""Where the installed PostgreSQL server's programs (initdb, pg_ctl) are, whatever its major version: for the replica
tests, and for `.ci/run`, which installs Debian's `postgresql` where this finds none (`python3 tests/pg_bin.py` prints
the directory, or exits 1). Standard library only: `.ci/run` runs it before the virtual environment exists."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

PROGRAMS = ("initdb", "pg_ctl")


def _version(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.parent.name))


def candidates(root: Path = Path("/usr/lib/postgresql")) -> list[Path]:
    """pg_config's bindir (Debian's wrapper answers for the newest server-dev package, else libpq's, which may have no
    server), then `root`/N/bin (Debian's layout), newest N first, then initdb's directory on PATH."""
    found: list[Path] = []
    if shutil.which("pg_config"):
        try:
            out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                found.append(Path(out.stdout.strip()))
        except (OSError, subprocess.TimeoutExpired):
            pass
    found += sorted(root.glob("*/bin"), key=_version, reverse=True)
    if shutil.which("initdb"):
        found.append(Path(shutil.which("initdb")).parent)
    return found


def find(root: Path = Path("/usr/lib/postgresql")) -> Path | None:
    """The first candidate directory that holds the server's programs, or None if no server is installed."""
    for directory in candidates(root):
        if all((directory / p).is_file() for p in PROGRAMS):
            return directory
    return None


if __name__ == "__main__":
    where = find()
    if where is None:
        sys.exit(1)
    print(where)
