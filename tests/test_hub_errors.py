"""A hub id that cannot be read (no network, or HF_HUB_OFFLINE without the repo in the cache) fails in one line that
says why and how to get the checkpoint, for `--model` and for `--attach-weights --weights`; nothing is written.

These machines have no hub access; the tests also force it: an empty HF_HOME, and HF_HUB_OFFLINE=1 or a hub
endpoint on a closed loopback port (huggingface_hub then retries 5 times, 23 s of back-off: the tests skip the
waits by making time.sleep return at once in the export's process).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

REPO = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
NO_SLEEP = "import sys, time\ntime.sleep = lambda seconds: None\nfrom export.__main__ import main\nsys.exit(main())\n"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _export(tmp_path: Path, *args: str, offline: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "HUGGINGFACE_"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HOME=str(tmp_path / "empty-hf-home"))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    return subprocess.run([sys.executable, "-c", NO_SLEEP, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable"])
def test_export_from_a_hub_id_without_the_hub(tmp_path: Path, offline: bool) -> None:
    out = tmp_path / "bundle"
    line = _one_line(_export(tmp_path, "--model", REPO, "--resolution", "480p", "--out", str(out), offline=offline))
    if offline:
        assert line.startswith(f"error: --model {REPO} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                               "set"), line
    else:
        assert line.startswith(f"error: cannot reach the Hugging Face hub to read --model {REPO}"), line
        assert "or set HF_HUB_OFFLINE=1 with the repo in the local Hugging Face cache" in line
    assert f"`hf download {REPO} --local-dir DIR`" in line and "pass --model DIR" in line
    assert not out.exists() and not list(tmp_path.glob(".bundle*"))


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable"])
def test_attach_weights_from_a_hub_id_without_the_hub(tmp_path: Path, offline: bool) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(ROOT / "artifacts" / "golden" / "schema-8" / "bundle", bundle)

    def digest() -> dict[str, str]:
        return {str(p.relative_to(bundle)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(bundle.rglob("*")) if p.is_file()}

    before = digest()
    line = _one_line(_export(tmp_path, "--attach-weights", str(bundle), "--weights", REPO, offline=offline))
    assert f"--weights {REPO}" in line and "pass --weights DIR" in line, line
    assert ("HF_HUB_OFFLINE is set" in line) == offline and ("cannot reach the Hugging Face hub" in line) != offline
    assert digest() == before and not list(tmp_path.glob(".bundle*"))  # no attach-partial copy left
