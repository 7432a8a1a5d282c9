"""The denoise steps' block loop (export/denoise_blocks.py): head -> one block program per block -> tail runs
what the same step compiled as one program runs, for every model kind and variant; its files are checked."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from runtime import kinds, signatures
from runtime.bundle import open_bundle
from runtime.errors import BundleError

from .conftest import KIND_CASES


def _sample(rng: np.random.Generator, name: str, spec) -> np.ndarray:  # noqa: ANN001
    if name == "timestep":
        return np.asarray(700, spec.dtype)  # float32 since schema 9 (int32 before)
    if name == "guidance":
        return np.asarray(4.5, np.float32)
    if name == "mask":  # "first_frame": frame 0 is the image
        mask = np.ones(spec.shape, np.float32)
        mask[:, :, 0] = 0
        return mask
    scale = 0.1 if name in ("row", "kv") else 1.0
    return (rng.standard_normal(spec.shape) * scale).astype(spec.dtype)


# The slow tier's kinds (another kind of the same path): their steps take what kinds the default run loops over take.
# FLF2V's are I2V's (CLIP's image keys and values, the conditioning latents concatenated), I2V-A14B's are that
# conditioning without CLIP on T2V-A14B's two experts. kind: the default run's kinds that cover it.
SLOW_KINDS = {"flf2v": "i2v", "i2v-moe": "i2v, t2v-moe"}


@pytest.mark.parametrize("case", ["t2v", *[pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS else k
                                           for k in KIND_CASES]])
def test_the_block_loop_runs_what_the_whole_step_runs(case, fp32_bundles, kind_bundles) -> None:
    path = fp32_bundles["tiny-64x32-f9"] if case == "t2v" else kind_bundles[case]
    b = open_bundle(path)
    m = b.manifest
    kind = kinds.get(m.kind)
    looped = sorted(n for n, p in m.programs.items() if p.blocks is not None)
    # every variant that runs the blocks loops over them; MagCache's cached step runs none
    assert looped == sorted(m.program_for(kinds.denoise_program(e, v), g) for g in m.shapes
                            for e in range(kind.experts) for v in ("cfg", "cond", "residual"))
    layers = m.source["config"]["transformer"]["num_layers"]
    assert layers >= 2
    programs = m.programs
    # one block program per batch size: the CFG and MagCache steps (2B) share one, the cond-only step (B) has its own
    assert programs["denoise_step"].blocks.block == programs["denoise_step_residual"].blocks.block
    assert programs["denoise_step"].blocks.block != programs["denoise_step_cond"].blocks.block
    rng = np.random.default_rng(0)
    for name in [n for n in looped if kinds.base_program(n) == n]:  # the default shape's (tests/test_shapes.py: the
        spec = programs[name]                                          # others are one-shape bundles' programs)
        assert spec.blocks.layers == layers and spec.blocks.prefix == "blocks."
        order = signatures.call_order(name, kind, spec).inputs
        args = [_sample(rng, n, spec.inputs[n]) for n in order]
        got = jax.tree.leaves(b.call(name)(*args))
        want = jax.tree.leaves(b.compile_whole(name)(b.weights(spec.weights, name), *map(jax.device_put, args)))
        assert len(got) == len(want) == len(spec.outputs)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0, atol=1e-5,
                                       err_msg=f"{case} {name}")
        assert bool(got[1]), "the step's finite flag"


def test_a_changed_block_or_tail_program_is_refused(fp32_bundles, tmp_path) -> None:
    src = fp32_bundles["tiny-64x32-f9"]
    spec = json.loads((src / "manifest.json").read_text())["programs"]["denoise_step"]["blocks"]
    for part in ("block", "tail"):
        copy = tmp_path / part
        shutil.copytree(src, copy)
        with open(copy / spec[part]["file"], "r+b") as f:  # one byte flipped, same size
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(BundleError, match=f"bundle file {spec[part]['file']} does not match its sha256"):
            open_bundle(copy)
