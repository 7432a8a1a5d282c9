"""A PostgreSQL server of a test's own: a fresh cluster (initdb) in a temporary directory on a loopback port, started
and stopped with pg_ctl as the `postgres` user when the tests run as root (the server refuses root). The replica
tests share one per module; the fault tests stop and start theirs while replicas use it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from . import pg_bin


def _as_postgres(*cmd: str) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """`url` is the admin URL (user postgres, database postgres, trust on loopback). Made, not started."""

    def __init__(self) -> None:
        bin_dir = pg_bin.find()
        if bin_dir is None:
            where = ", ".join(map(str, pg_bin.candidates()))
            raise AssertionError(f"PostgreSQL's server is not installed (no initdb in {where or '/usr/lib/postgresql'}"
                                 "): apt-get install postgresql (.ci/run does)")
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="wan-aot-pg-"))
        self.root.chmod(0o755)
        self.data, self.sock = self.root / "data", self.root / "sock"
        self.sock.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.sock, "postgres")
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        subprocess.run(_as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"),
                       check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        subprocess.run(_as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o",
                                    f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 "
                                    "-c max_connections=200", "-l", str(self.root / "log"), "-w", "start"),
                       check=True, capture_output=True, timeout=120)

    def stop(self, mode: str = "fast") -> None:
        subprocess.run(_as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"),
                       capture_output=True, timeout=120)

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
