"""Programs built from a config alone (--no-weights), weights attached later (--attach-weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

import runtime
import runtime.manifest as mf

from .conftest import CASES, run_module


def _export(out: Path, model: str, dtype: str, *extra: str) -> Path:
    _, res, frames, max_len = CASES["tiny-64x32-f9"]
    run_module("export", "--model", model, "--resolution", res, "--frames", str(frames), "--dtype", dtype,
               "--max-sequence-length", str(max_len), "--out", str(out), "-q", *extra)
    return out


def _files(bundle: Path) -> dict[str, str]:
    return {ref.file: ref.sha256 for ref in mf.read(bundle).files()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_attached_bundle_equals_a_direct_export(checkpoints, fp32_bundles, tmp_path: Path, dtype: str) -> None:
    """Tracing on `meta` tensors gives the same programs, and attaching gives the same weight files
    (bf16 included: tied embeddings and the DiT's fp32-kept modules are reproduced)."""
    ckpt = str(checkpoints["tiny"])
    bare = _export(tmp_path / "bare", ckpt, dtype, "--no-weights")
    m = mf.read(bare)
    assert not m.has_weights and m.tokenizer is None and not list((bare / "weights").glob("*"))
    assert all(w.file is None for w in m.weights.values())
    with pytest.raises(runtime.errors.BundleError, match="no weights attached"):
        runtime.load(bare)
    run_module("export", "--attach-weights", str(bare), "--weights", ckpt, "-q")
    direct = fp32_bundles["tiny-64x32-f9"] if dtype == "fp32" else _export(tmp_path / "direct", ckpt, dtype)
    assert _files(bare) == _files(direct)
    assert mf.read(bare).source["weights"]["kind"] == "directory"
    runtime.load(bare)  # every file checks out


def test_wrong_weights_are_refused_and_nothing_changes(checkpoints, tmp_path: Path) -> None:
    bare = _export(tmp_path / "bare", "tiny", "fp32", "--no-weights")
    before = {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()}
    proc = run_module("export", "--attach-weights", str(bare), "--weights", str(checkpoints["tiny-wide"]),
                      check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("error: ") and "does not match the bundle's architecture" in line
    assert {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare"]


def test_attaching_twice_needs_force(checkpoints, fp32_bundles, tmp_path: Path) -> None:
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(fp32_bundles["tiny-64x32-f9"], bundle)
    proc = run_module("export", "--attach-weights", str(bundle), "--weights", str(checkpoints["tiny"]), check=False)
    assert proc.returncode == 2 and "already has weights: pass --force" in proc.stderr
    proc = run_module("export", "--attach-weights", str(bundle), check=False)
    assert proc.returncode == 2 and "needs --weights" in proc.stderr


@pytest.mark.parametrize("kind", ["i2v", "i2v-moe"])
def test_attach_for_image_and_two_expert_models(kind: str, kind_checkpoints, kind_bundles, tmp_path: Path) -> None:
    """The CLIP image encoder, the second expert and the VAE encoder are attached like the rest."""
    from .conftest import KIND_CASES

    _, res, frames, max_len = KIND_CASES[kind]
    bare = tmp_path / "bare"
    run_module("export", "--model", str(kind_checkpoints[kind]), "--resolution", res, "--frames", str(frames),
               "--dtype", "fp32", "--max-sequence-length", str(max_len), "--no-weights", "--out", str(bare), "-q")
    before = {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()}
    other = "t2v-moe" if kind == "i2v-moe" else "flf2v"  # the same family, another kind
    proc = run_module("export", "--attach-weights", str(bare), "--weights", str(kind_checkpoints[other]), check=False)
    assert proc.returncode == 2 and "does not match the bundle's model: its kind is" in proc.stderr.strip()
    assert {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()} == before
    run_module("export", "--attach-weights", str(bare), "--weights", str(kind_checkpoints[kind]), "-q")
    assert _files(bare) == _files(kind_bundles[kind])
    groups = set(mf.read(bare).weights)
    assert groups == ({"text_encoder", "image_encoder", "transformer", "vae"} if kind == "i2v" else
                      {"text_encoder", "transformer", "transformer_2", "vae"})
    assert any(t.startswith("encoder.") for t in mf.read(bare).weights["vae"].tensors)  # the VAE encoder too
