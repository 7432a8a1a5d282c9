"""Target presets, --mesh, and the up-front checks that a mesh fits the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from export import sharding
from runtime import targets
from runtime.errors import UserError

from .conftest import run_module


def test_presets_follow_the_seeds() -> None:
    v6e8 = targets.get("tpu-v6e-8")
    assert (v6e8.platform, v6e8.mesh, v6e8.num_devices) == ("tpu", {"dp": 2, "sp": 1, "tp": 4}, 8)
    assert v6e8.device_kind == "TPU v6 lite"
    assert targets.get("cpu").num_devices == 1 and targets.get("cuda").platform == "cuda"
    assert targets.get("cpu-8").num_devices == 8
    assert targets.get("tpu-v6e-16").num_devices == 16 and targets.get("tpu-v4-8").num_devices == 4


def test_mesh_override() -> None:
    t = targets.resolve("tpu-v6e-8", "dp=2,sp=2,tp=2")
    assert t.mesh == {"dp": 2, "sp": 2, "tp": 2} and t.platform == "tpu" and t.name == "tpu-v6e-8[dp=2,sp=2,tp=2]"
    assert targets.resolve("cpu", "tp=4").mesh == {"dp": 1, "sp": 1, "tp": 4}
    for bad in ("dp=2,xp=4", "tp=0", "tp", "dp=2,dp=2"):
        with pytest.raises(UserError, match="--mesh"):
            targets.resolve("cpu", bad)


def test_partition_rules() -> None:
    mesh = {"dp": 2, "sp": 1, "tp": 4}
    p = sharding.partition
    assert p("wan_transformer", "blocks.3.attn1.to_q.weight", (5120, 5120), mesh) == sharding.PartitionSpec("tp")
    assert p("wan_transformer", "blocks.3.attn2.to_out.0.weight", (5120, 5120), mesh) == \
        sharding.PartitionSpec(None, "tp")
    assert p("wan_transformer", "blocks.0.ffn.net.2.weight", (5120, 13824), mesh) == sharding.PartitionSpec(None, "tp")
    assert p("wan_transformer", "patch_embedding.weight", (5120, 16, 1, 2, 2), mesh) == sharding.PartitionSpec()
    assert p("umt5", "shared.weight", (256384, 4096), mesh) == sharding.PartitionSpec(("dp", "sp", "tp"))
    assert p("umt5", "encoder.final_layer_norm.weight", (4099,), mesh) == sharding.PartitionSpec()
    assert p("wan_vae", "decoder.conv_in.weight", (384, 16, 3, 3, 3), mesh) == sharding.PartitionSpec()


@pytest.mark.parametrize("n,heads,want", [(8, 12, "dp=2,sp=1,tp=4"), (8, 6, "dp=2,sp=2,tp=2"),
                                          (16, 12, "dp=2,sp=2,tp=4"), (8, 40, "dp=2,sp=1,tp=4")])
def test_suggested_meshes_fit(n: int, heads: int, want: str) -> None:
    shape = sharding.DitShape(heads=heads, tokens=32760, batch=2)
    assert sharding.suggest_meshes(n, shape)[0] == want


def _export_error(tmp_path: Path, *args: str) -> str:
    out = tmp_path / "bundle"
    proc = run_module("export", *args, "--out", str(out), "-q", check=False)
    assert proc.returncode == 2, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".bundle*"))
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_heads_that_do_not_divide_suggest_a_mesh(tmp_path: Path) -> None:
    msg = _export_error(tmp_path, "--model", "wan2.1-t2v-1.3b", "--no-weights", "--resolution", "480p",
                        "--target", "tpu-v6e-16")
    assert "12 attention heads do not divide over tp=8" in msg and "--mesh dp=2,sp=2,tp=4" in msg


def test_unknown_target_and_bad_mesh(tmp_path: Path) -> None:
    assert "unknown target 'tpu-v9'" in _export_error(tmp_path, "--resolution", "64x32", "--frames", "5",
                                                      "--target", "tpu-v9")
    assert "--mesh" in _export_error(tmp_path, "--resolution", "64x32", "--frames", "5", "--mesh", "dp=two")
    assert "dp=4" in _export_error(tmp_path, "--resolution", "64x32", "--frames", "5", "--mesh", "dp=4")


def test_architecture_name_needs_no_weights(tmp_path: Path) -> None:
    assert "--no-weights" in _export_error(tmp_path, "--model", "wan2.1-t2v-14b", "--resolution", "720p")
