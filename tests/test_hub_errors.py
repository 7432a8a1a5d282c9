"""A hub id that cannot be read (no network, or HF_HUB_OFFLINE without the repo in the cache) fails in one line that
says why and how to get the checkpoint, for `--model` and for `attach BUNDLE --weights`; nothing is written.

These machines have no hub access; the tests also force it: an empty HF_HOME, and HF_HUB_OFFLINE=1 or a hub
endpoint on a closed loopback port (huggingface_hub then retries 5 times, 23 s of back-off: the tests skip the
waits by making time.sleep return at once in the export's process). Each way of being without the hub is one process
(the hub library reads its environment when imported) that runs both commands, `--model` then `attach`, each
with its own exit code and stderr: one import of the build libraries instead of two.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

REPO = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
# `python -m export ARGV` for each (ARGV, stderr file) of the JSON in sys.argv[1], one after the other, each one's
# stderr (file descriptor 2: logging's too) in its file; prints their exit codes, a JSON list.
NO_SLEEP = """
import json, os, sys, time
time.sleep = lambda seconds: None
from export.__main__ import main
codes = []
for argv, err in json.loads(sys.argv[1]):
    sys.stderr.flush()
    saved, fd = os.dup(2), os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
    codes.append(0 if code is None else code)
print(json.dumps(codes))
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exports(root: Path, commands: list[list[str]], offline: bool) -> list[subprocess.CompletedProcess]:
    """`python -m export ARGS` of each command, one after the other in one process without the hub (an empty HF_HOME;
    HF_HUB_OFFLINE=1, or a hub endpoint on a closed port); each one's exit code and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "HUGGINGFACE_"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HOME=str(root / "empty-hf-home"))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    errs = [root / f"{i}.err" for i in range(len(commands))]
    proc = subprocess.run([sys.executable, "-c", NO_SLEEP, json.dumps([[c, str(e)] for c, e in zip(commands, errs)])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess(["export", *c], code, "", e.read_text())
            for c, code, e in zip(commands, codes, errs)]


def _digest(bundle: Path) -> dict[str, str]:
    return {str(p.relative_to(bundle)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(bundle.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def without_the_hub(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], tuple]:
    """(command, offline): (its directory, its completed process) for `--model REPO` (out: DIR/bundle) and
    `attach DIR/bundle --weights REPO` (a golden bundle's copy, with its files' digests before), each
    without the hub either way. Each command has a directory of its own."""
    out = {}
    for offline in (True, False):
        root = tmp_path_factory.mktemp("offline" if offline else "unreachable")
        model, attach = root / "model", root / "attach"
        model.mkdir()
        shutil.copytree(ROOT / "artifacts" / "golden" / "schema-8" / "bundle", attach / "bundle")
        before = _digest(attach / "bundle")
        procs = _exports(root, [["--model", REPO, "--resolution", "480p", "--out", str(model / "bundle")],
                                ["attach", str(attach / "bundle"), "--weights", REPO]], offline)
        out["model", offline] = (model, procs[0])
        out["attach", offline] = (attach, procs[1], before)
    return out


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable"])
def test_export_from_a_hub_id_without_the_hub(without_the_hub, offline: bool) -> None:
    directory, proc = without_the_hub["model", offline]
    out = directory / "bundle"
    line = _one_line(proc)
    if offline:
        assert line.startswith(f"error: --model {REPO} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                               "set"), line
    else:
        assert line.startswith(f"error: cannot reach the Hugging Face hub to read --model {REPO}"), line
        assert "or set HF_HUB_OFFLINE=1 with the repo in the local Hugging Face cache" in line
    assert f"`hf download {REPO} --local-dir DIR`" in line and "pass --model DIR" in line
    assert not out.exists() and not list(directory.glob(".bundle*")) and not list(directory.iterdir())


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable"])
def test_attach_weights_from_a_hub_id_without_the_hub(without_the_hub, offline: bool) -> None:
    directory, proc, before = without_the_hub["attach", offline]
    bundle = directory / "bundle"
    line = _one_line(proc)
    assert f"--weights {REPO}" in line and "pass --weights DIR" in line, line
    assert ("HF_HUB_OFFLINE is set" in line) == offline and ("cannot reach the Hugging Face hub" in line) != offline
    assert _digest(bundle) == before and not list(directory.glob(".bundle*"))  # no attach-partial copy left
