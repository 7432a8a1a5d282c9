"""Samplers as coefficient rows (runtime/samplers.py) against diffusers' own schedulers and WanPipeline: euler
(FlowMatchEulerDiscreteScheduler), dpm++ (DPMSolverMultistepScheduler, flow, 2M) and custom sigmas, on the same
exported programs; run defaults recorded in the bundle (--defaults, a checkpoint's scheduler); LoRAs merged at
export (--merge-lora, a ComfyUI-named file); and what bad input says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import samplers, scheduler
from runtime.errors import UserError

from .conftest import CASES, run_cli, run_module, run_modules
from .test_lora import wan_format_lora

PROMPT = "a paper boat drifting down a rainy street"
NEGATIVE = "blurry"
CASE = "tiny-64x32-f9"
FP32_TOL = 1e-4
LIGHTX2V_SIGMAS = (1.0, 0.75, 0.5, 0.25)  # lightx2v's denoising_step_list [1000, 750, 500, 250]


def _euler(shift: float):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def _dpm(shift: float):
    from diffusers import DPMSolverMultistepScheduler

    return DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                       algorithm_type="dpmsolver++", solver_order=2, num_train_timesteps=1000)


def _unipc(shift: float):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                   num_train_timesteps=1000)


def _flowmap(shift: float):
    from diffusers import FlowMapEulerDiscreteScheduler

    return FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def _run_diffusers(sched, steps: int, x: np.ndarray, velocity, sigmas=None) -> tuple[np.ndarray, np.ndarray]:
    import torch

    if sigmas is None:
        sched.set_timesteps(steps)
    else:
        sched.set_timesteps(steps, sigmas=np.array(sigmas))
    sample = torch.from_numpy(x.copy())
    for i, t in enumerate(sched.timesteps):
        v = torch.from_numpy(velocity(i, sample.numpy()))
        sample = sched.step(v, t, sample, return_dict=False)[0]
    return sched.timesteps.numpy().astype(np.float64), sample.numpy()


def _run_rows(plan: scheduler.Plan, x: np.ndarray, velocity, order: int = 2) -> np.ndarray:
    state = np.zeros((scheduler.state_rows(order), *x.shape), np.float32)
    state[0] = x
    for i in range(len(plan.timesteps)):
        state = scheduler.apply_row(state, velocity(i, state[0]), plan.coeffs[i], order).astype(np.float32)
    return state[0]


def _velocity(seed: int):
    """A fixed nonlinear 'model' v_i(x), so that each sampler's errors would show."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(2, 64, 4, 8)).astype(np.float32)
    return lambda i, x: np.tanh(a * x + b + 0.1 * i).astype(np.float32)


@pytest.mark.parametrize("name,steps,shift,sigmas", [
    ("euler", 4, 5.0, None), ("euler", 4, 5.0, LIGHTX2V_SIGMAS), ("euler", 9, 3.0, None), ("euler", 30, 8.0, None),
    ("dpm++", 7, 3.0, None), ("dpm++", 2, 5.0, None), ("dpm++", 20, 12.0, None), ("dpm++", 50, 1.0, None),
    ("unipc", 4, 5.0, LIGHTX2V_SIGMAS), ("unipc", 10, 3.0, (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)),
    ("flowmap", 1, 5.0, None), ("flowmap", 3, 1.0, None), ("flowmap", 16, 5.0, None), ("flowmap", 4, 3.0, LIGHTX2V_SIGMAS),
])
def test_rows_follow_the_diffusers_scheduler(name: str, steps: int, shift: float, sigmas) -> None:
    """The coefficient rows, applied as the step program applies them, give diffusers' scheduler's samples, and
    the same timesteps (Euler's fractional)."""
    reference = {"euler": _euler, "dpm++": _dpm, "unipc": _unipc, "flowmap": _flowmap}[name](shift)
    x = np.random.default_rng(0).normal(size=(64, 4, 8)).astype(np.float32)
    velocity = _velocity(1)
    ref_t, ref_x = _run_diffusers(reference, steps, x, velocity, sigmas)
    plan = samplers.plan(name, steps, shift, scheduler.UniPCConfig(flow_shift=shift), sigmas)
    np.testing.assert_allclose(plan.timesteps, ref_t, rtol=0, atol=1e-3 if name in ("euler", "flowmap") else 0)
    np.testing.assert_allclose(plan.sigmas, reference.sigmas.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(_run_rows(plan, x, velocity), ref_x, rtol=0, atol=2e-5)


def test_samplers_differ_and_euler_timesteps_are_fractional() -> None:
    cfg = scheduler.UniPCConfig(flow_shift=5.0)
    plans = {n: samplers.plan(n, 4, 5.0, cfg) for n in samplers.SAMPLERS}
    assert not np.array_equal(plans["euler"].timesteps, np.round(plans["euler"].timesteps))
    for name in ("unipc", "dpm++"):
        np.testing.assert_array_equal(plans[name].timesteps, np.round(plans[name].timesteps))
    assert len({p.coeffs.tobytes() for p in plans.values()}) == len(samplers.SAMPLERS) == 4


def test_settings_resolve_sigmas_steps_and_bad_values() -> None:
    from runtime import kinds
    from runtime.manifest import Defaults
    from runtime.settings import resolve

    t2v, moe = kinds.get("t2v"), kinds.get("t2v-moe")
    cfg = scheduler.UniPCConfig()
    d = Defaults(steps=4, guidance=1.0, flow_shift=5.0, sampler="euler", sigmas=LIGHTX2V_SIGMAS)
    s = resolve(d, t2v, cfg)
    assert (s.sampler, s.steps, s.sigmas, s.guidance) == ("euler", 4, LIGHTX2V_SIGMAS, 1.0)
    assert resolve(d, t2v, cfg, steps=6).sigmas is None  # other steps: the sampler's own schedule
    assert resolve(d, t2v, cfg, sigmas=[0.9, 0.5]).steps == 2
    assert resolve(d, t2v, cfg, sampler="unipc").sigmas == LIGHTX2V_SIGMAS
    assert resolve(Defaults(4, 1.0, 5.0, guidance_2=2.0), moe, cfg).guidance_2 == 2.0
    for kwargs, message in [
        (dict(sampler="ddim"), "sampler 'ddim' is not one of unipc, euler, dpm++"),
        (dict(sigmas=[1.0, 0.5, 0.6]), "sigmas must be strictly decreasing and in (0, 1]"),
        (dict(sigmas=[1.5, 0.5]), "sigmas must be strictly decreasing and in (0, 1]"),
        (dict(sigmas=[0.5, 0.0]), "sigmas must be strictly decreasing and in (0, 1]"),
        (dict(sigmas=[1.0, 0.5], steps=3), "2 sigmas for 3 steps: give one sigma per step"),
        (dict(sigmas=[]), "sigmas is empty"),
        (dict(sigmas="1,0.5"), "sigmas must be a list of numbers"),
    ]:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            resolve(d, t2v, cfg, **kwargs)


# -- end to end, against WanPipeline ---------------------------------------------------------------------------
def _wan(checkpoint: Path, scheduler_obj=None):
    import torch
    from diffusers import WanPipeline

    kwargs = {} if scheduler_obj is None else {"scheduler": scheduler_obj}
    ref = WanPipeline.from_pretrained(str(checkpoint), dtype=torch.float32, **kwargs)
    ref.set_progress_bar_config(disable=True)
    return ref


def _reference_frames(ref, pipe: runtime.Pipeline, init: np.ndarray, steps: int, guidance: float,
                      sigmas=None, negative: str = NEGATIVE) -> np.ndarray:
    import functools

    import torch

    g = pipe.geometry
    if sigmas is not None:  # WanPipeline takes no sigmas: give them to its scheduler's set_timesteps
        ref.scheduler.set_timesteps = functools.partial(ref.scheduler.set_timesteps, sigmas=np.array(sigmas))
    with torch.no_grad():
        return ref(prompt=PROMPT, negative_prompt=negative, height=g.height, width=g.width, num_frames=g.frames,
                   num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=g.max_sequence_length,
                   latents=torch.from_numpy(init.copy()), output_type="np").frames


@pytest.mark.parametrize("sampler,steps,guidance,shift,sigmas", [
    ("euler", 4, 1.0, 5.0, None),  # a step-distilled model's run: 4 steps, no CFG
    ("euler", 4, 1.0, 5.0, LIGHTX2V_SIGMAS),  # lightx2v's 4 steps
    ("dpm++", 7, 5.0, 3.0, None),
])
def test_matches_wan_pipeline_with_that_scheduler(sampler, steps, guidance, shift, sigmas, fp32_bundles,
                                                  checkpoints) -> None:
    pipe = runtime.load(fp32_bundles[CASE])
    init = pipe.initial_latents(3)
    frames = pipe.generate(PROMPT, NEGATIVE, seed=3, steps=None if sigmas else steps, guidance=guidance,
                           flow_shift=shift, sampler=sampler, sigmas=sigmas, progress=False)
    reference = {"euler": _euler, "dpm++": _dpm}[sampler](shift)
    ref = _reference_frames(_wan(checkpoints[CASES[CASE][0]], reference), pipe, init, steps, guidance, sigmas)
    assert frames.shape == ref.shape
    assert np.abs(frames - ref).max() <= FP32_TOL
    assert frames.std() > 1e-3
    unipc = pipe.generate(PROMPT, NEGATIVE, seed=3, steps=steps, guidance=guidance, flow_shift=shift, progress=False)
    assert np.abs(unipc - frames).max() > 1e-3  # the sampler made a difference


@pytest.fixture(scope="module")
def distilled(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Two bundles of the tiny model, exported side by side: `euler-checkpoint`, a checkpoint saved with
    FlowMatchEulerDiscreteScheduler(shift=5) (no flags: its sampler and shift become the bundle's defaults); and
    `lora-4step`, the UniPC checkpoint with a ComfyUI-named LoRA merged and a distilled model's run defaults."""
    root = tmp_path_factory.mktemp("distilled")
    variant, res, frames, max_len = CASES[CASE]
    euler_ckpt = root / "euler-checkpoint-src"
    shutil.copytree(checkpoints[variant], euler_ckpt)
    shutil.rmtree(euler_ckpt / "scheduler")
    _euler(5.0).save_pretrained(str(euler_ckpt / "scheduler"))
    index = json.loads((euler_ckpt / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    (euler_ckpt / "model_index.json").write_text(json.dumps(index))
    lora = wan_format_lora(checkpoints[variant], root / "lora", seed=4)
    common = ["--resolution", res, "--frames", str(frames), "--dtype", "fp32", "--max-sequence-length", str(max_len),
              "-q"]
    out = {"euler-checkpoint": root / "euler", "lora-4step": root / "lora-4step", "lora": lora,
           "euler-src": euler_ckpt}
    run_modules(["export", "--model", str(euler_ckpt), "--out", str(out["euler-checkpoint"]), *common],
                ["export", "--model", str(checkpoints[variant]), "--merge-lora", f"{lora}:0.7",
                 "--defaults", "steps=4,guidance=1,sampler=euler,flow_shift=5", "--out", str(out["lora-4step"]),
                 *common])
    return out


def test_a_checkpoint_with_an_euler_scheduler_samples_with_it_by_default(distilled) -> None:
    pipe = runtime.load(distilled["euler-checkpoint"])
    d = pipe.manifest.defaults
    assert (d.sampler, d.flow_shift, d.steps, d.guidance) == ("euler", 5.0, 50, 5.0)
    init = pipe.initial_latents(5)
    frames = pipe.generate(PROMPT, NEGATIVE, seed=5, steps=4, guidance=1.0, progress=False)
    ref = _reference_frames(_wan(distilled["euler-src"]), pipe, init, 4, 1.0)  # the checkpoint's own scheduler
    assert np.abs(frames - ref).max() <= FP32_TOL


def test_a_merged_lora_bundle_with_defaults_needs_no_flags(distilled, checkpoints, tmp_path) -> None:
    """The 4-step CFG-free recipe of the distilled LoRAs: --merge-lora (ComfyUI keys, scale 0.7) and --defaults at
    export; `generate` with no flags matches WanPipeline with the LoRA loaded (load_lora_weights) and Euler at
    shift 5, 4 steps, guidance 1; and the CLI with no flags makes that video too."""
    from safetensors.numpy import load_file

    pipe = runtime.load(distilled["lora-4step"])
    d = pipe.manifest.defaults
    assert (d.sampler, d.steps, d.guidance, d.flow_shift) == ("euler", 4, 1.0, 5.0)
    merged = pipe.manifest.source["merged_loras"]
    assert [(m["file"], m["scale"], m["into"]) for m in merged] == [("wan_lora.safetensors", 0.7, "transformer")]
    init = pipe.initial_latents(0)
    frames = pipe.generate(PROMPT, NEGATIVE, progress=False)
    ref_pipe = _wan(checkpoints[CASES[CASE][0]], _euler(5.0))
    ref_pipe.load_lora_weights(str(distilled["lora"]), adapter_name="distill")
    ref_pipe.set_adapters(["distill"], [0.7])
    ref = _reference_frames(ref_pipe, pipe, init, 4, 1.0)
    assert np.abs(frames - ref).max() <= FP32_TOL
    plain = _reference_frames(_wan(checkpoints[CASES[CASE][0]], _euler(5.0)), pipe, init, 4, 1.0)
    assert np.abs(plain - ref).max() > 1e-3  # the LoRA changed the video
    # The CLI with no flags: the bundle's defaults (the frames it saves are generate's).
    out = tmp_path / "v.mp4"
    run_module("runtime", "generate", str(distilled["lora-4step"]), "--prompt", PROMPT, "--negative-prompt",
               NEGATIVE, "--out", str(out), "--frames-out", str(tmp_path / "f.safetensors"), "-q")
    assert out.stat().st_size > 0
    np.testing.assert_allclose(load_file(str(tmp_path / "f.safetensors"))["frames"], frames, rtol=0, atol=1e-6)


def test_bad_sampler_settings_are_one_line_errors(fp32_bundles, tmp_path) -> None:
    bundle = str(fp32_bundles[CASE])
    out = tmp_path / "x.mp4"
    for args, message in [
        (["--sampler", "ddim"], "error: sampler 'ddim' is not one of unipc, euler, dpm++"),
        (["--sigmas", "1,0.5,0.7"], "error: sigmas must be strictly decreasing and in (0, 1]"),
        (["--sigmas", "1,0.5", "--steps", "3"], "error: 2 sigmas for 3 steps"),
        (["--sigmas", "1,x"], "error: sigmas '1,x' is not a comma-separated list of numbers"),
    ]:
        proc = run_cli("runtime", "generate", bundle, "--prompt", "a", "--out", str(out), *args, check=False)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not out.exists()


def test_bad_export_defaults_and_loras_are_one_line_errors(checkpoints, tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    ckpt = str(checkpoints["tiny"])
    foreign = tmp_path / "foreign.safetensors"  # names that match no weight of the model
    save_file({"diffusion_model.blocks.0.cross_attn.nonexistent.lora_down.weight": torch.zeros(2, 24),
               "diffusion_model.blocks.0.cross_attn.nonexistent.lora_up.weight": torch.zeros(24, 2)}, str(foreign))
    wide = wan_format_lora(checkpoints["tiny-wide"], tmp_path / "wide", seed=1)  # another model size
    base = ["export", "--model", ckpt, "--resolution", "64x32", "--frames", "5", "--out", str(tmp_path / "b")]
    for args, message in [
        (["--defaults", "steps=4,sampler=ddim"], "error: --defaults: sampler 'ddim' is not one of"),
        (["--defaults", "guidance_2=2"], "error: --defaults: guidance_2 (--guidance-2) is for two-expert models"),
        (["--defaults", "stepz=4"], "error: --defaults 'stepz=4': 'stepz=4' is not KEY=VALUE"),
        (["--defaults", "steps=3,sigmas=1,0.5"], "error: --defaults: 2 sigmas for 3 steps"),
        (["--merge-lora", str(foreign)], f"error: LoRA {foreign}: its tensor names (e.g. "),
        (["--merge-lora", str(wide)], f"error: --merge-lora {wide}: "),
        (["--merge-lora-2", str(wide)], f"error: --merge-lora-2 {wide} targets transformer_2, which this model"),
        (["--merge-lora", str(tmp_path / "missing.safetensors")], "error: LoRA "),
    ]:
        proc = run_cli(*base, *args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert not (tmp_path / "b").exists()


def test_a_distilled_dit_in_the_original_wan_layout_attaches_with_run_defaults(checkpoints, tmp_path) -> None:
    """lightx2v's full step-distilled DiT files: original Wan names, bf16. Attached to a --no-weights bf16 bundle with
    the checkpoint's encoders and VAE (--dit-weights) and the distilled run's defaults (--defaults), the bundle's DiT
    is the file's, bit for bit, and runs with no flags."""
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file

    from export.prequantized import diffusers_names

    from .test_quantize import lightx2v_file

    ckpt = checkpoints["tiny"]
    plain = lightx2v_file(ckpt, "transformer", tmp_path / "plain.safetensors", None)
    distilled = {k: (v * 0.9).to(torch.bfloat16) for k, v in load_torch(str(plain)).items()}  # "another" model
    save_file(distilled, str(tmp_path / "distill.safetensors"))
    bundle = tmp_path / "bundle"
    run_module("export", "--model", str(ckpt), "--no-weights", "--resolution", "64x32", "--frames", "5",
               "--dtype", "bf16", "--max-sequence-length", "16", "--out", str(bundle), "-q")
    run_module("export", "attach", str(bundle), "--weights", str(ckpt), "--dit-weights",
               str(tmp_path / "distill.safetensors"), "--defaults", "steps=2,guidance=1,sampler=euler,flow_shift=5",
               "-q")
    assert "ready to run" in run_cli("runtime", "verify", str(bundle)).stdout
    pipe = runtime.load(bundle)
    assert (pipe.manifest.defaults.steps, pipe.manifest.defaults.sampler) == (2, "euler")
    got = load_file(str(bundle / "weights" / "transformer.safetensors"))
    names = diffusers_names(list(distilled))
    assert len(names) == len(distilled) and all(names[k] in got for k in distilled)
    for old, new in names.items():  # bf16 as the file has it (the bundle keeps diffusers' fp32 modules in fp32)
        assert np.array_equal(got[new].astype(np.float32), distilled[old].float().numpy()), new
    assert pipe.generate("a kite", progress=False).std() > 1e-3
