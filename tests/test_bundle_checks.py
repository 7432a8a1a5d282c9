"""Bad bundles and bad export arguments fail with one clear line and write nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import runtime
from runtime.errors import BundleError

from .conftest import run_cli


@pytest.fixture()
def bundle_copy(fp32_bundles, tmp_path: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(fp32_bundles["tiny-64x32-f9"], dst)
    return dst


def _rewrite_manifest(bundle: Path, edit) -> None:
    from runtime.manifest import canonical_json, content_id

    data = json.loads((bundle / "manifest.json").read_text())
    edit(data)
    data["bundle_id"] = content_id(data)
    (bundle / "manifest.json").write_text(canonical_json(data))


def test_tampered_weights_are_refused(bundle_copy: Path) -> None:
    path = bundle_copy / "weights" / "transformer.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    pipe = runtime.load(bundle_copy)  # weight files are hashed as they are read, before any program uses them
    with pytest.raises(BundleError, match="transformer.safetensors does not match its sha256"):
        pipe.generate("x", steps=2, progress=False)


def test_edited_manifest_is_refused(bundle_copy: Path) -> None:
    data = json.loads((bundle_copy / "manifest.json").read_text())
    data["defaults"]["steps"] = 7
    (bundle_copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="modified after export"):
        runtime.load(bundle_copy)


def test_path_escaping_the_bundle_is_refused(bundle_copy: Path) -> None:
    _rewrite_manifest(bundle_copy, lambda d: d["tokenizer"].update(file="../../etc/passwd"))
    with pytest.raises(BundleError, match="escapes the bundle"):
        runtime.load(bundle_copy)


def test_unknown_schema_and_missing_manifest(bundle_copy: Path, tmp_path: Path) -> None:
    data = json.loads((bundle_copy / "manifest.json").read_text())
    data["schema_version"] = 99
    (bundle_copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="schema version 99"):
        runtime.load(bundle_copy)
    with pytest.raises(BundleError, match="no manifest.json"):
        runtime.load(tmp_path)


def test_cli_reports_bundle_errors_in_one_line(bundle_copy: Path, tmp_path: Path) -> None:
    (bundle_copy / "stages" / "denoise_step.jaxexport").write_bytes(b"garbage")
    out = tmp_path / "v.mp4"
    proc = run_cli("runtime", "generate", str(bundle_copy), "--prompt", "x", "--out", str(out), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    (["--resolution", "100x64"], "multiple of 16"),
    (["--resolution", "64x64", "--frames", "10"], "4k+1"),
    (["--resolution", "64x64", "--model", "no-such-model"], "unknown model"),
    (["--resolution", "64x64", "--target", "tpu-v99"], "unknown target"),
])
def test_export_argument_errors(args: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "b"
    proc = run_cli("export", *args, "--out", str(out), check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_export_refuses_existing_output(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    proc = run_cli("export", "--resolution", "32x32", "--frames", "1", "--out", str(tmp_path / "b"), check=False)
    assert proc.returncode == 2 and "already exists" in proc.stderr
