"""Issue 13's speed-ups against diffusers on tiny fp32 models: CFG-free steps and MagCache."""

from __future__ import annotations

import json

import numpy as np
import pytest

import runtime
from runtime import scheduler
from runtime.errors import UserError
from runtime.magcache import MagCache

from .conftest import CASES, run_cli, run_module

PROMPT = "a red fox running through snow"
NEGATIVE = "blurry"
CASE = "tiny-64x32-f9"


def _programs(pipe: runtime.Pipeline, steps: int, magcache: MagCache | None = None, **kw) -> list[str]:
    s = pipe.settings(steps=steps, **kw)
    plan = scheduler.plan(s.steps, s.flow_shift, pipe.scheduler_config)
    return pipe.step_programs(s.steps, plan.timesteps, s, magcache)


def _diffusers_call(pipe: runtime.Pipeline, seed: int, steps: int, guidance: float, max_len: int) -> dict:
    import torch

    g = pipe.geometry
    return dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width, num_frames=g.frames,
                num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=max_len,
                latents=torch.from_numpy(pipe.initial_latents(seed).copy()), output_type="latent")


def test_guidance_one_runs_the_cond_program_with_the_same_result(fp32_bundles, checkpoints) -> None:
    import torch
    from diffusers import WanPipeline

    pipe = runtime.load(fp32_bundles[CASE])
    assert _programs(pipe, 3, guidance=1.0) == ["denoise_step_cond"] * 3
    assert _programs(pipe, 3, guidance=1.5) == ["denoise_step"] * 3
    programs = pipe.manifest.programs  # one kv for both: the cond-only step uses its first B rows
    assert programs["denoise_step_cond"].inputs["kv"] == programs["denoise_step"].inputs["kv"]
    embeds = pipe.encode(PROMPT, NEGATIVE)
    fast = pipe.denoise(embeds, seed=3, steps=3, guidance=1.0, progress=False)
    pipe.step_programs = lambda *a, **k: ["denoise_step"] * 3  # today's program: cond + uncond, cond returned
    full = pipe.denoise(embeds, seed=3, steps=3, guidance=1.0, progress=False)
    np.testing.assert_allclose(fast, full, rtol=0, atol=1e-5)

    ref = WanPipeline.from_pretrained(str(checkpoints[CASES[CASE][0]]), dtype=torch.float32)
    with torch.no_grad():  # diffusers runs no uncond pass at guidance 1 either
        ref_latents = ref(**_diffusers_call(pipe, 3, 3, 1.0, CASES[CASE][3])).frames.numpy()
    np.testing.assert_allclose(fast, ref_latents, rtol=0, atol=1e-4)


def test_two_experts_pick_the_cond_program_per_expert(kind_bundles) -> None:
    pipe = runtime.load(kind_bundles["t2v-moe"])
    programs = _programs(pipe, 6, guidance=4.0, guidance_2=1.0)
    experts = [0 if p.startswith("denoise_step_2") is False else 1 for p in programs]
    assert experts == sorted(experts) and 0 in experts and 1 in experts  # the boundary falls inside
    assert {p for p in programs if not p.startswith("denoise_step_2")} == {"denoise_step"}
    assert {p for p in programs if p.startswith("denoise_step_2")} == {"denoise_step_2_cond"}
    embeds = pipe.encode(PROMPT, NEGATIVE)
    fast = pipe.denoise(embeds, seed=1, steps=6, guidance=4.0, guidance_2=1.0, progress=False)
    pipe.step_programs = lambda *a, **k: [p.removesuffix("_cond") for p in programs]
    full = pipe.denoise(embeds, seed=1, steps=6, guidance=4.0, guidance_2=1.0, progress=False)
    np.testing.assert_allclose(fast, full, rtol=0, atol=1e-5)


# -- MagCache -------------------------------------------------------------------------------------------------

def test_schedule_is_diffusers_rule() -> None:
    """The rule by hand on a few cases (diffusers' MagCacheHeadHook, step by step)."""
    # retention int(0.2 * 10 + 0.5) = 2: steps 0, 1 run; step 2 has a residual and no drift: skipped; at most 3
    # skipped in a row, then the accumulators reset.
    assert MagCache([1.0] * 10).schedule([0] * 10) == [True, True, False, False, False, True, False, False, False,
                                                       True]
    # retention int(1.7) = 1; drift: |1 - 0.9| = 0.1 > 0.06 computes (and resets); 0.97 then 0.97^2:
    # 0.03 + 0.0591 > 0.06 at the 2nd
    assert MagCache([1.0, 1.0, 0.9, 0.97, 0.97, 1.0]).schedule([0] * 6) == [True, False, True, False, True, False]
    # the ratios are nearest-interpolated to the step count: [1, 1, 0.5] at 5 steps is [1, 1, 1, 0.5, 0.5]
    assert MagCache([1.0, 1.0, 0.5]).interpolated(5).tolist() == [1.0, 1.0, 1.0, 0.5, 0.5]
    assert MagCache([1.0] * 8, threshold=0.0, max_skip_steps=0).schedule([0] * 8) == [True] * 8
    # two experts: each phase has its own retention and starts without a residual
    assert MagCache([1.0] * 10, retention_ratio=0.0).schedule([0] * 4 + [1] * 6) == \
        [True, False, False, False, True, False, False, False, True, False]


@pytest.mark.parametrize("bad, message", [
    (dict(ratios=[]), "non-empty list"),
    (dict(ratios=[1.0, float("nan")]), "finite numbers > 0"),
    (dict(ratios=[1.0], threshold=-1), "threshold must be a finite number >= 0"),
    (dict(ratios=[1.0], max_skip_steps=1.5), "max_skip_steps must be an integer >= 0"),
    (dict(ratios=[1.0], retention_ratio=2), "retention_ratio must be a number in [0, 1]"),
])
def test_bad_magcache_settings(bad: dict, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MagCache(**bad)


def _diffusers_magcache(checkpoint, pipe: runtime.Pipeline, cache: MagCache | None, steps: int, guidance: float,
                        max_len: int, seed: int) -> tuple[np.ndarray, np.ndarray | None, list[bool], list[float]]:
    """diffusers' WanPipeline with its MagCache hook (calibration mode without `cache`): latents, frames (not
    when calibrating), which steps ran the blocks, and the cond context's calibration ratios."""
    import contextlib
    import io

    import torch
    from diffusers import MagCacheConfig, WanPipeline

    ref = WanPipeline.from_pretrained(str(checkpoint), dtype=torch.float32)
    if cache is None:
        config = MagCacheConfig(calibrate=True, num_inference_steps=steps)
    else:
        config = MagCacheConfig(threshold=cache.threshold, max_skip_steps=cache.max_skip_steps,
                                retention_ratio=cache.retention_ratio, num_inference_steps=steps,
                                mag_ratios=list(cache.ratios))
    ref.transformer.enable_cache(config)
    ran: list[int] = [0]  # calls of the first block's self-attention (cond and uncond), per step
    ref.transformer.blocks[0].attn1.register_forward_hook(lambda *_: ran.__setitem__(-1, ran[-1] + 1))

    def next_step(pipeline, i, t, kwargs):
        ran.append(0)
        return kwargs

    printed = io.StringIO()
    call = _diffusers_call(pipe, seed, steps, guidance, max_len)
    with torch.no_grad(), contextlib.redirect_stdout(printed):
        latents = ref(**call, callback_on_step_end=next_step).frames.numpy()
        frames = None if cache is None else ref(**{**call, "output_type": "np"}).frames
    # calibration prints each context's ratios when it ends, "cond" first
    lists = [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("[") and
             not line.startswith("[MagCache]")]
    return latents, frames, [n > 0 for n in ran[:steps]], lists[0] if lists else []


def test_magcache_matches_diffusers_hook(fp32_bundles, checkpoints) -> None:
    """Same ratios and settings: diffusers' hook skips the same steps and the latents and frames agree (1e-4)."""
    variant, _, _, max_len = CASES[CASE]
    pipe = runtime.load(fp32_bundles[CASE])
    steps, guidance = 10, 5.0
    cache = MagCache([1.0, 1.0, 1.01, 0.99, 1.02, 0.97, 1.0, 1.0, 0.98, 1.0, 1.0, 1.0], threshold=0.05,
                     max_skip_steps=2, retention_ratio=0.2)
    schedule = cache.schedule([0] * steps)
    assert 2 <= schedule.count(False) <= steps - 4  # something is skipped, and not everything
    ref_latents, ref_frames, ref_ran, _ = _diffusers_magcache(checkpoints[variant], pipe, cache, steps, guidance,
                                                              max_len, 5)
    assert ref_ran == schedule
    assert [p.endswith("_cached") for p in _programs(pipe, steps, cache)] == [not c for c in schedule]

    embeds = pipe.encode(PROMPT, NEGATIVE)
    latents = pipe.denoise(embeds, seed=5, steps=steps, guidance=guidance, progress=False, magcache=cache)
    np.testing.assert_allclose(latents, ref_latents, rtol=0, atol=1e-4)
    uncached = pipe.denoise(embeds, seed=5, steps=steps, guidance=guidance, progress=False)
    assert np.abs(uncached - latents).max() > 1e-3  # the skipped steps did skip
    frames = pipe.decode(latents)
    assert frames.shape == ref_frames.shape and np.abs(frames - ref_frames).max() <= 1e-4


def test_calibrate_matches_diffusers_calibration(fp32_bundles, checkpoints, tmp_path) -> None:
    variant, _, _, max_len = CASES[CASE]
    pipe = runtime.load(fp32_bundles[CASE])
    *_, ref = _diffusers_magcache(checkpoints[variant], pipe, None, 5, 5.0, max_len, 2)
    embeds = pipe.encode(PROMPT, NEGATIVE)
    ours = pipe.calibrate(embeds, seed=2, steps=5, guidance=5.0, progress=False)
    assert len(ours) == len(ref) == 5 and ours[0] == 1.0
    np.testing.assert_allclose(ours, ref, rtol=1e-4)

    out = tmp_path / "ratios.json"
    run_module("runtime", "calibrate", str(fp32_bundles[CASE]), "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
               "--steps", "5", "--seed", "2", "--out", str(out))
    written = json.loads(out.read_text())
    np.testing.assert_allclose(written["mag_ratios"], ours, rtol=1e-5)
    assert written["bundle_id"] == pipe.bundle_id and written["steps"] == 5


def test_two_expert_calibration_resets_at_the_boundary(kind_bundles) -> None:
    pipe = runtime.load(kind_bundles["t2v-moe"])
    programs = _programs(pipe, 6, guidance=4.0)
    boundary = next(i for i, p in enumerate(programs) if p.startswith("denoise_step_2"))
    ratios = pipe.calibrate(pipe.encode(PROMPT), seed=0, steps=6, guidance=4.0, progress=False)
    assert len(ratios) == 6 and ratios[0] == ratios[boundary] == 1.0
    assert all(r != 1.0 for i, r in enumerate(ratios) if i not in (0, boundary))
    cache = MagCache([1.0] * 6, retention_ratio=0.0)
    assert _programs(pipe, 6, cache, guidance=4.0)[boundary] == "denoise_step_2_residual"
    cached = pipe.denoise(pipe.encode(PROMPT), seed=0, steps=6, guidance=4.0, progress=False, magcache=cache)
    assert np.isfinite(cached).all()


def test_generate_cli_magcache(fp32_bundles, tmp_path) -> None:
    ratios = tmp_path / "ratios.json"
    ratios.write_text(json.dumps([1.0] * 6))
    out = tmp_path / "cached.mp4"
    proc = run_module("runtime", "generate", str(fp32_bundles[CASE]), "--prompt", PROMPT, "--steps", "6",
                      "--magcache", str(ratios), "--magcache-threshold", "0.1", "--magcache-max-skip", "2",
                      "--magcache-retention", "0.3", "--out", str(out))
    assert out.exists() and out.stat().st_size > 0, proc.stderr
    bad = run_cli("runtime", "generate", str(fp32_bundles[CASE]), "--prompt", PROMPT, "--magcache",
                     str(tmp_path / "missing.json"), "--out", str(tmp_path / "no.mp4"), check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "missing.json does not exist" in bad.stderr and not (tmp_path / "no.mp4").exists()
