"""Cross-attention over a short prompt's rows (export/cross_kv.py): a CPU bundle's cross_kv_t<T> programs and the
block programs for their keys and values give the steps what the whole-text programs give them, for every model
kind and variant; the runtime picks the shortest that holds the prompt, and loads nothing for the whole text."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import runtime
from runtime import kinds, signatures
from runtime import manifest as mf
from runtime.bundle import open_bundle

from .conftest import KIND_CASES
from .test_denoise_blocks import _sample


def _context(rng: np.random.Generator, spec: mf.TensorSpec, rows: int) -> np.ndarray:
    """(2B, L, D) embeddings whose rows from `rows` on are zero, as the text encoder pads them."""
    context = rng.standard_normal(spec.shape).astype(np.float32)
    context[:, rows:] = 0
    return context


# the default run: one expert, two, and image cross-attention (CLIP); the slow tier: the other kinds, same programs
DEFAULT_CASES = ("t2v", "t2v-moe", "i2v")


@pytest.mark.parametrize("case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in ["t2v", *KIND_CASES]])
def test_short_prompt_keys_and_values_give_the_steps_what_the_whole_text_gives(case, fp32_bundles,
                                                                              kind_bundles) -> None:
    path = fp32_bundles["tiny-64x32-f9"] if case == "t2v" else kind_bundles[case]
    b = open_bundle(path)
    m = b.manifest
    kind = kinds.get(m.kind)
    L = m.geometry.max_sequence_length
    shorts = kinds.short_text_lengths(L)
    assert shorts and sorted(m.programs) == sorted(m.stages(short_prompts=True))
    full = m.programs[kinds.cross_kv_program(0)]
    rng = np.random.default_rng(1)
    for t in (shorts[0], shorts[-1]):
        context = _context(rng, full.inputs["context"], t - 1)  # one zero row inside the T rows too
        extras = [_sample(rng, n, full.inputs[n]) for n in kind.kv_inputs[1:]]
        for e in range(kind.experts):
            kv_full = b.call(kinds.cross_kv_program(e))(context, *extras)
            kv_short = b.call(kinds.cross_kv_program(e, t))(context[:, :t], *extras)
            assert kv_short.shape[4] == kv_full.shape[4] - L + t + 1  # T rows and one for the L - T zero rows
            for v in kinds.DENOISE_VARIANTS:
                name = kinds.denoise_program(e, v)
                spec = m.programs[name]
                order = signatures.call_order(name, kind, spec).inputs
                if "kv" not in order:  # MagCache's cached step runs no block
                    assert v == "cached" and spec.blocks is None
                    continue
                args = {n: _sample(rng, n, spec.inputs[n]) for n in order}
                want = jax.tree.leaves(b.call(name)(*[kv_full if n == "kv" else args[n] for n in order]))
                got = jax.tree.leaves(b.call(name)(*[kv_short if n == "kv" else args[n] for n in order]))
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0,
                                               atol=2e-5, err_msg=f"{case} {name} T={t}")
                assert b.block_part(name, [kv_short]) == f"block_t{t}"


def test_the_runtime_picks_the_shortest_rows_that_hold_the_prompt(fp32_bundles) -> None:
    pipe = runtime.load(fp32_bundles["tiny-64x32-f9"])
    L = pipe.geometry.max_sequence_length
    shorts = kinds.short_text_lengths(L)
    spec = pipe.manifest.programs[kinds.cross_kv_program(0)].inputs["context"]
    rng = np.random.default_rng(2)
    for t in shorts:
        assert pipe.text_rows(_context(rng, spec, t)) == t
        assert pipe.text_rows(_context(rng, spec, t - 1)) == ([s for s in shorts if s >= t - 1][0])
    assert pipe.text_rows(_context(rng, spec, shorts[-1] + 1)) is None  # longer than the longest short program
    nan = _context(rng, spec, 1)
    nan[0, L - 1, 0] = np.nan  # not zero: the whole text, so the step sees it
    assert pipe.text_rows(nan) is None
    # a bundle whose steps cannot take them (here: a step program without short blocks) gets the whole text
    assert pipe.text_rows(_context(rng, spec, 1), ["denoise_step"]) == shorts[0]
    loop = pipe.manifest.programs["denoise_step"].blocks
    pipe.manifest.programs["denoise_step"] = mf.ProgramSpec(
        **{**pipe.manifest.programs["denoise_step"].__dict__, "blocks": mf.BlockLoop(
            **{**loop.__dict__, "short_blocks": {}})})
    assert pipe.text_rows(_context(rng, spec, 1), ["denoise_step"]) is None


def test_generate_loads_only_the_programs_for_the_prompts_length(fp32_bundles) -> None:
    pipe = runtime.load(fp32_bundles["tiny-64x32-f9"])
    frames = pipe.generate("a cat", "blurry", steps=2, progress=False)
    assert np.isfinite(frames).all()
    t = kinds.short_text_lengths(pipe.geometry.max_sequence_length)[0]  # a two-word prompt fits the shortest
    compiled = {k.removeprefix("compile ") for k in pipe.bundle.timings if k.startswith("compile ")}
    assert {f"cross_kv_t{t}", f"denoise_step:block_t{t}"} <= compiled
    assert not compiled & {"cross_kv", "denoise_step:block"} and not any(
        k.startswith("cross_kv_t") and k != f"cross_kv_t{t}" for k in compiled)
    # a prompt longer than the short programs hold runs the whole text's
    long = " ".join(["word"] * pipe.geometry.max_sequence_length)
    pipe.generate(long, steps=2, progress=False)
    compiled = {k.removeprefix("compile ") for k in pipe.bundle.timings if k.startswith("compile ")}
    assert {"cross_kv", "denoise_step:block"} <= compiled


def test_tpu_style_bundles_without_short_programs_run_the_whole_text(fp32_bundles) -> None:
    """A bundle without cross_kv_t programs (TPU targets, schema 5) runs every prompt with the whole text's."""
    pipe = runtime.load(fp32_bundles["tiny-64x32-f9"])
    for name in [n for n in pipe.manifest.programs if kinds.is_cross_kv(n) and n != kinds.cross_kv_program(0)]:
        del pipe.manifest.programs[name]
    spec = pipe.manifest.programs[kinds.cross_kv_program(0)].inputs["context"]
    assert pipe.text_rows(_context(np.random.default_rng(3), spec, 1)) is None
    pipe.generate("a cat", steps=1, progress=False)
    assert "compile cross_kv" in pipe.bundle.timings
