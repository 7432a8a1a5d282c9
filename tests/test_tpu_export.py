"""Programs for TPU slices built on this CPU-only machine from an architecture name alone.

Real sizes: Wan2.1-14B at 720p / 81 frames for tpu-v6e-8, and 1.3B at 480p for a 4-chip
v6e. Nothing runs here (no TPU); the tests read what was baked into the programs.
"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec

import runtime.manifest as mf
from export import sharding
from export.build import FAMILIES
from runtime.bundle import partition_spec

from .conftest import run_module

CASES = {  # name: (architecture, resolution, target, devices, heads)
    "14b-720p-v6e-8": ("wan2.1-t2v-14b", "720p", "tpu-v6e-8", 8, 40),
    "1.3b-480p-v6e-4": ("wan2.1-t2v-1.3b", "480p", "tpu-v6e-4", 4, 12),
}


@pytest.fixture(scope="module")
def tpu_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tpu")
    for case, (arch, res, target, _, _) in CASES.items():
        run_module("export", "--model", arch, "--no-weights", "--resolution", res, "--frames", "81",
                   "--target", target, "--out", str(root / case), "-q")
    return {case: root / case for case in CASES}


def _program(bundle: Path, name: str) -> jax.export.Exported:
    return jax.export.deserialize(bytearray((bundle / "stages" / f"{name}.jaxexport").read_bytes()))


def _weight_specs(exp: jax.export.Exported) -> dict[str, PartitionSpec | None]:
    """Each weight's sharding in the program (None: the program does not use that tensor)."""
    (weights, *_), _ = jax.tree.unflatten(exp.in_tree, exp._in_named_shardings)
    return {k: None if s is None else s.spec for k, s in weights.items()}


@pytest.mark.parametrize("case", CASES)
def test_dit_program_has_the_tpu_kernel_and_the_mesh(tpu_bundles: dict[str, Path], case: str) -> None:
    _, _, target, devices, heads = CASES[case]
    m = mf.read(tpu_bundles[case])
    assert m.target.name == target and m.target.num_devices == devices and not m.has_weights
    assert m.attention["dit"]["impl"] == "pallas-tpu-flash"
    assert m.source["config"]["transformer"]["num_attention_heads"] == heads
    for name in m.programs:
        exp = _program(tpu_bundles[case], name)
        assert exp.platforms == ("tpu",) and exp.nr_devices == devices
        mesh = exp._in_named_shardings[0].mesh
        assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == m.target.mesh
        assert mesh.abstract_device.device_kind == "TPU v6 lite"
        assert ("tpu_custom_call" in exp.mlir_module()) == (name == "denoise_step")


@pytest.mark.parametrize("case", CASES)
def test_weights_are_sharded_as_the_table_says(tpu_bundles: dict[str, Path], case: str) -> None:
    bundle = tpu_bundles[case]
    m = mf.read(bundle)
    for name, prog in m.programs.items():
        specs = _weight_specs(_program(bundle, name))
        wf = m.weights[prog.weights]
        assert set(specs) == set(wf.tensors)
        unused = [t for t, spec in specs.items() if spec is None]
        assert len(unused) <= 4, (name, unused)  # vae_decode_first skips the temporal upsamplers
        for tensor, spec in specs.items():
            want = sharding.partition(FAMILIES[prog.weights], tensor, wf.tensors[tensor].shape, m.target.mesh)
            assert want == partition_spec(wf.partition[tensor]), (name, tensor)
            assert spec in (want, None), (name, tensor)
    dit = _weight_specs(_program(bundle, "denoise_step"))
    assert dit["blocks.0.attn1.to_q.weight"] == PartitionSpec("tp")  # column-parallel
    assert dit["blocks.0.attn2.to_out.0.weight"] == PartitionSpec(None, "tp")  # row-parallel
    assert dit["blocks.0.ffn.net.0.proj.weight"] == PartitionSpec("tp")
    assert dit["blocks.0.ffn.net.2.weight"] == PartitionSpec(None, "tp")
    assert dit["scale_shift_table"] == PartitionSpec()
    te = _weight_specs(_program(bundle, "text_encoder"))
    assert te["shared.weight"] == PartitionSpec(("dp", "sp", "tp"))  # FSDP over every device
    assert all(s == PartitionSpec() for s in _weight_specs(_program(bundle, "vae_decode_next")).values())


def test_vae_activations_split_on_width(tpu_bundles: dict[str, Path]) -> None:
    exp = _program(tpu_bundles["14b-720p-v6e-8"], "vae_decode_next")
    (_, latents, *caches), _ = jax.tree.unflatten(exp.in_tree, exp._in_named_shardings)
    assert latents.spec == PartitionSpec(None, None, None, None, ("dp", "sp", "tp"))
    assert caches and all(c.spec[-1] == ("dp", "sp", "tp") for c in caches)
    assert exp.out_avals[0].shape == (1, 4, 720, 1280, 3)


def test_runtime_refuses_a_bundle_without_weights(tpu_bundles: dict[str, Path], tmp_path: Path) -> None:
    bundle = tpu_bundles["1.3b-480p-v6e-4"]
    proc = run_module("runtime", "generate", str(bundle), "--prompt", "x", "--out", str(tmp_path / "v.mp4"),
                      check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: bundle {bundle} has no weights attached (exported with --no-weights): "
                                   f"run `python -m export --attach-weights {bundle} --weights CHECKPOINT` first")
    assert not (tmp_path / "v.mp4").exists()
