"""Programs built from a config alone (--no-weights), weights attached later (python -m export attach)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

import runtime
import runtime.manifest as mf

from .conftest import CASES, KIND_CASES, OnDemand, run_module


def _files(bundle: Path) -> dict[str, str]:
    return {ref.file: ref.sha256 for ref in mf.read(bundle).files()}


@pytest.fixture(scope="module")
def bare(checkpoints, kind_checkpoints, tmp_path_factory: pytest.TempPathFactory) -> OnDemand:
    """Programs without weights (--no-weights): the tiny checkpoint in fp32 and bf16 (as tiny-64x32-f9), and the
    image-to-video kinds (as conftest's kind bundles); those the default run uses exported at once, two at a time, the
    others when first asked for. Tests attach into copies."""
    root = tmp_path_factory.mktemp("bare")
    _, res, frames, max_len = CASES["tiny-64x32-f9"]
    cases = {dtype: (checkpoints["tiny"], res, frames, max_len, dtype) for dtype in ("fp32", "bf16")}
    cases.update({kind: (kind_checkpoints[kind], *KIND_CASES[kind][1:], "fp32") for kind in ("i2v", "i2v-moe")})
    def command(name: str) -> list[str]:
        ckpt, res, frames, max_len, dtype = cases[name]
        return ["export", "--model", str(ckpt), "--resolution", res, "--frames", str(frames), "--dtype", dtype,
                "--max-sequence-length", str(max_len), "--no-weights", "--out", str(root / name), "-q"]

    def export(name: str) -> Path:  # the slow tier's variants (bf16, i2v), when first asked for
        run_module(*command(name))
        return root / name

    return OnDemand.start({name: functools.partial(export, name) for name in cases}, now=["fp32", "i2v-moe"])


def _copy(bundle: Path, to: Path) -> Path:
    shutil.copytree(bundle, to)
    return to


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])  # bf16: a variant
def test_attached_bundle_equals_a_direct_export(bare, checkpoints, fp32_bundles, bf16_bundle, tmp_path: Path,
                                                dtype: str) -> None:
    """Tracing on `meta` tensors gives the same programs, and attaching gives the same weight files
    (bf16 included: tied embeddings and the DiT's fp32-kept modules are reproduced)."""
    ckpt = str(checkpoints["tiny"])
    bundle = _copy(bare[dtype], tmp_path / "bare")
    m = mf.read(bundle)
    assert not m.has_weights and m.tokenizer is None and not list((bundle / "weights").glob("*"))
    assert all(w.file is None for w in m.weights.values())
    with pytest.raises(runtime.errors.BundleError, match="no weights attached"):
        runtime.load(bundle)
    run_module("export", "attach", str(bundle), "--weights", ckpt, "-q")
    direct = fp32_bundles["tiny-64x32-f9"] if dtype == "fp32" else bf16_bundle
    assert _files(bundle) == _files(direct)
    assert mf.read(bundle).source["weights"]["kind"] == "directory"
    runtime.load(bundle)  # every file checks out


def test_wrong_weights_are_refused_and_nothing_changes(bare, checkpoints, tmp_path: Path) -> None:
    bare = _copy(bare["fp32"], tmp_path / "bare")
    before = {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()}
    proc = run_module("export", "attach", str(bare), "--weights", str(checkpoints["tiny-wide"]),
                      check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("error: ") and "does not match the bundle's architecture" in line
    assert {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare"]


def test_attaching_twice_needs_force(checkpoints, fp32_bundles, tmp_path: Path) -> None:
    bundle = _copy(fp32_bundles["tiny-64x32-f9"], tmp_path / "b")
    proc = run_module("export", "attach", str(bundle), "--weights", str(checkpoints["tiny"]), check=False)
    assert proc.returncode == 2 and "already has weights: pass --force" in proc.stderr
    proc = run_module("export", "attach", str(bundle), check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == ("error: python -m export attach: the following arguments "
                                                             "are required: --weights (see python -m export attach "
                                                             "--help)")


@pytest.mark.parametrize("kind", [pytest.param("i2v", marks=pytest.mark.slow), "i2v-moe"])  # i2v-moe: image + 2 experts
def test_attach_for_image_and_two_expert_models(kind: str, bare, kind_checkpoints, kind_bundles,
                                                 tmp_path: Path) -> None:
    """The CLIP image encoder, the second expert and the VAE encoder are attached like the rest."""
    bare = _copy(bare[kind], tmp_path / "bare")
    before = {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()}
    other = "t2v-moe" if kind == "i2v-moe" else "flf2v"  # the same family, another kind
    proc = run_module("export", "attach", str(bare), "--weights", str(kind_checkpoints[other]), check=False)
    assert proc.returncode == 2 and "does not match the bundle's model: its kind is" in proc.stderr.strip()
    assert {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()} == before
    run_module("export", "attach", str(bare), "--weights", str(kind_checkpoints[kind]), "-q")
    assert _files(bare) == _files(kind_bundles[kind])
    groups = set(mf.read(bare).weights)
    assert groups == ({"text_encoder", "image_encoder", "transformer", "vae"} if kind == "i2v" else
                      {"text_encoder", "transformer", "transformer_2", "vae"})
    assert any(t.startswith("encoder.") for t in mf.read(bare).weights["vae"].tensors)  # the VAE encoder too
