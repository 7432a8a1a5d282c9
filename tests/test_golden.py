"""Frozen bundles from earlier exporters still load and reproduce their recorded output.

artifacts/golden/schema-N/ holds a bundle of the embedded tiny model as the exporter of
manifest schema N wrote it (tools/make_golden.py), and the latents and frames of a fixed
generation as that version's runtime produced them. A format change that breaks old bundles,
or a numerical change in any stage, fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import manifest as mf

from .conftest import ROOT, run_cli

GOLDEN = ROOT / "artifacts" / "golden"
DIRS = sorted(GOLDEN.glob("schema-*"), key=lambda p: int(p.name.split("-")[1]))
# XLA CPU may vectorize differently on another CPU; a format or semantics break moves frames by far more.
TOL = 1e-4


def _expected(d: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(d / "expected.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_every_readable_schema_has_a_golden_bundle() -> None:
    oldest = mf.SCHEMA_VERSION
    while oldest - 1 in mf.MIGRATIONS:
        oldest -= 1
    assert [int(d.name.split("-")[1]) for d in DIRS] == list(range(oldest, mf.SCHEMA_VERSION + 1))


@pytest.mark.parametrize("golden", DIRS, ids=lambda d: d.name)
def test_golden_bundle_reproduces_its_output(golden: Path) -> None:
    want, meta = _expected(golden)
    gen = json.loads(meta["generation"])
    pipe = runtime.load(golden / "bundle")
    assert pipe.manifest.schema_version == mf.SCHEMA_VERSION and pipe.bundle_id == meta["bundle_id"]
    embeds = pipe.encode(gen["prompt"], gen["negative_prompt"])
    latents = pipe.denoise(embeds, seed=gen["seed"], steps=gen["steps"], guidance=gen["guidance"], progress=False)
    np.testing.assert_allclose(latents, want["latents"], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(pipe.decode(latents), want["frames"], atol=TOL, rtol=0)


def test_verify_reads_old_schemas_through_migration() -> None:
    proc = run_cli("runtime", "verify", str(DIRS[0] / "bundle"))
    assert f"schema {DIRS[0].name.split('-')[1]} " in proc.stdout and "ready to run" in proc.stdout
    if len(DIRS) > 1:
        assert "read through the migration" in proc.stdout
