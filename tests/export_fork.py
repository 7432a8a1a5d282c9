"""`python -m export ARGS` for the tests, forked from a server that has its imports loaded (tests/export_preload.py)
instead of started anew: the same separate process, exit code, stdout and stderr, without ten seconds of imports each.
One fork server per test process (multiprocessing's forkserver), started on the first export. What the build
libraries read from the environment when imported (HF_HUB_OFFLINE, HF_HOME, ...) is the server's: a test that changes
those runs `python -m export` as a plain subprocess (tests/test_hub_errors.py)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading

_lock = threading.Lock()
_context = None


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, status: str) -> None:
    """In the forked process: the directory, environment and output files `python -m export` would have, then its
    main; its exit code also written to `status` (the forkserver's own report of it was once lost: 255)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    from export.__main__ import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(status, "w") as f:
        f.write(str(0 if code is None else int(code)))
    sys.exit(code)


def context() -> multiprocessing.context.BaseContext:
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["tests.export_preload"])
            _context = ctx
        return _context


def start(argv: list[str], env: dict[str, str], cwd: str, logs: str) -> multiprocessing.process.BaseProcess:
    """`python -m export ARGV` started (not awaited) in `cwd` with environment `env`, its stdout, stderr and exit code
    written under the directory `logs`; the process (its pid, kill, join) is the caller's."""
    out, err, status = (os.path.join(logs, name) for name in ("out", "err", "status"))
    for path in (out, err):
        open(path, "w").close()
    proc = context().Process(target=_child, args=(argv, env, cwd, out, err, status))
    proc.start()
    return proc


def run(argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m export ARGV` in `cwd` with environment `env`; as subprocess.run(..., capture_output=True) returns
    it. Raises subprocess.TimeoutExpired (the process killed) after `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="wan-aot-export-") as logs:
        out, err, status = (os.path.join(logs, name) for name in ("out", "err", "status"))
        for path in (out, err):
            open(path, "w").close()
        proc = context().Process(target=_child, args=(argv, env, cwd, out, err, status))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["python", "-m", "export", *argv], timeout)
        code = proc.exitcode
        if os.path.exists(status):  # main returned: its code (a crash or a kill leaves none: the process's)
            with open(status) as f:
                code = int(f.read())
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(["python", "-m", "export", *argv], code, o.read(), e.read())
