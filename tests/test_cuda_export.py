"""Programs for NVIDIA GPU nodes (the cuda-2, cuda-4 and cuda-8 presets) built on this CPU-only machine from
architecture names, as the TPU ones are (tests/test_tpu_export.py): the mesh and the sharding rules of the TPU presets,
attention in plain XLA (no Pallas TPU kernel, no cuDNN custom call). No GPU was lent to this project's machines: nothing
here runs them; the tests read what was baked into the programs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import pytest

import runtime.manifest as mf
from runtime import targets
from runtime.summary import summarize

from .conftest import in_parallel, run_module
from .test_tpu_export import check_weight_shardings

CASES = {  # name: (architecture, resolution, target, frames)
    "14b-720p-cuda-8": ("wan2.1-t2v-14b", "720p", "cuda-8", 81),
    "a14b-720p-cuda-4": ("wan2.2-t2v-a14b", "720p", "cuda-4", 81),  # two experts
    "1.3b-480p-cuda-2": ("wan2.1-t2v-1.3b", "480p", "cuda-2", 81),
}


@pytest.fixture(scope="module")
def cuda_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda")

    def export(case: str) -> None:
        arch, res, target, frames = CASES[case]
        run_module("export", "--model", arch, "--no-weights", "--resolution", res, "--frames", str(frames),
                   "--target", target, "--out", str(root / case), "-q")

    in_parallel(*[functools.partial(export, case) for case in CASES])
    return {case: root / case for case in CASES}


def test_presets() -> None:
    """dp=2 carries the CFG halves (no communication between them); tp splits weights and heads within 2 or 4 GPUs."""
    assert {n: (t.platform, t.mesh, t.device_kind) for n, t in targets.PRESETS.items() if n.startswith("cuda-")} == {
        "cuda-2": ("cuda", {"dp": 2, "sp": 1, "tp": 1}, ""), "cuda-4": ("cuda", {"dp": 2, "sp": 1, "tp": 2}, ""),
        "cuda-8": ("cuda", {"dp": 2, "sp": 1, "tp": 4}, "")}


@pytest.mark.parametrize("case", CASES)
def test_programs_are_for_cuda_on_the_mesh_with_xla_attention(cuda_bundles: dict[str, Path], case: str) -> None:
    m = mf.read(cuda_bundles[case])
    target = targets.get(CASES[case][2])
    assert (m.target.name, m.target.platform, m.target.mesh, m.target.num_devices) == \
        (target.name, "cuda", target.mesh, target.num_devices) and not m.has_weights
    assert m.attention["impl"] == "xla-blocked" and "dit" not in m.attention  # no Pallas kernel entry
    files = {f.file for spec in m.programs.values() for f in spec.files()}
    assert any("denoise_block" in f for f in files)  # the DiT's block programs are among them
    for file in sorted(files):
        exp = jax.export.deserialize(bytearray((cuda_bundles[case] / file).read_bytes()))
        assert exp.platforms == ("cuda",) and exp.nr_devices == target.num_devices, file
        shardings = [s for s in exp._in_named_shardings if s is not None]
        if target.num_devices > 1:
            mesh = shardings[0].mesh
            assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == target.mesh and mesh.abstract_device is None, file
        text = exp.mlir_module()
        assert "tpu_custom_call" not in text and "cudnn" not in text.lower(), file  # plain XLA attention


@pytest.mark.parametrize("case", CASES)
def test_weights_are_sharded_as_the_tpu_presets_are(cuda_bundles: dict[str, Path], case: str) -> None:
    check_weight_shardings(cuda_bundles[case])


def test_bytes_per_device_follow_the_mesh(cuda_bundles: dict[str, Path]) -> None:
    """dp replicates the DiT, tp splits it: cuda-2 holds the whole 1.3B DiT on each GPU, cuda-4 about half of each
    A14B expert, cuda-8 about a quarter of the 14B's; the text encoder is FSDP over every GPU."""
    def weights(case: str) -> dict:
        return summarize(cuda_bundles[case], mf.read(cuda_bundles[case]))["weights"]

    two, four, eight = weights("1.3b-480p-cuda-2"), weights("a14b-720p-cuda-4"), weights("14b-720p-cuda-8")
    assert two["transformer"]["bytes_per_device"] == two["transformer"]["bytes"]
    for w, tp in ((four, 2), (eight, 4)):
        share = w["transformer"]["bytes_per_device"] / w["transformer"]["bytes"]
        assert 1 / tp < share < 1 / tp + 0.02, share  # the replicated norms, embedders and head add a little
    assert four["transformer_2"]["bytes_per_device"] == four["transformer"]["bytes_per_device"]
    for w, n in ((two, 2), (four, 4), (eight, 8)):
        assert abs(w["text_encoder"]["bytes_per_device"] * n / w["text_encoder"]["bytes"] - 1) < 0.01
