"""AnyFlow (issue 63): a flow-map distilled Wan 2.1 (AnyFlowTransformer3DModel: r beside t, per-frame timesteps) run
at any step count by one bundle, against diffusers' AnyFlowPipeline on the same tiny random model, fp32, the same
initial noise: 1, 2, 4 and 8 steps, guidance > 1, use_mean_velocity=False (sampler euler) and continuing a video's
first frames; what a bundle of this kind refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .conftest import run_cli, run_module, shared

torch = pytest.importorskip("torch")

W, H, FRAMES = 64, 32, 9
TOL = 1e-4  # the issue's: frames within 1e-4 of diffusers in fp32
PROMPT, NEGATIVE = "a red cat", "blurry"


@pytest.fixture(scope="module")
def anyflow() -> tuple[Path, Path]:
    """(the tiny AnyFlow checkpoint, its fp32 bundle at 64x32 x 9 frames)."""
    from export import tiny

    ckpt = shared("anyflow-checkpoint", lambda root: tiny.save("tiny-anyflow", root / "ckpt")) / "ckpt"
    bundle = shared("anyflow-bundle", lambda root: run_module(
        "export", "--model", str(ckpt), "--resolution", f"{W}x{H}", "--frames", str(FRAMES), "--dtype", "fp32",
        "--max-sequence-length", "16", "--out", str(root / "anyflow"), "-q")) / "anyflow"
    return ckpt, bundle


@pytest.fixture(scope="module")
def reference(anyflow: tuple[Path, Path]):  # noqa: ANN201 (diffusers' AnyFlowPipeline)
    from diffusers import AnyFlowPipeline

    pipe = AnyFlowPipeline.from_pretrained(str(anyflow[0]), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(anyflow: tuple[Path, Path]):  # noqa: ANN201
    import runtime

    return runtime.load(anyflow[1])


def _noise(seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, (FRAMES - 1) // 4 + 1, H // 8, W // 8, generator=g).numpy()


def _diffusers(ref, noise: np.ndarray, steps: int, guidance: float = 1.0, **kw: object) -> np.ndarray:
    return ref(PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_frames=FRAMES, num_inference_steps=steps,
               guidance_scale=guidance, latents=torch.from_numpy(noise.copy()), max_sequence_length=16,
               output_type="np", **kw).frames


def _ours(pipe, noise: np.ndarray, steps: int, guidance: float = 1.0, **kw: object) -> np.ndarray:
    return pipe.generate(PROMPT, NEGATIVE, steps=steps, guidance=guidance, latents=noise, progress=False, **kw)


def test_any_step_count_matches_diffusers(pipe, reference) -> None:
    """1, 2, 4 and 8 steps of one bundle (the step count is data: no program per count), each within 1e-4 of
    AnyFlowPipeline's frames; the counts give frames far apart, so each run is its own schedule."""
    noise = _noise()
    made = {}
    for steps in (1, 2, 4, 8):
        made[steps] = _ours(pipe, noise, steps)
        ref = _diffusers(reference, noise, steps)
        assert made[steps].shape == ref.shape == (1, FRAMES, H, W, 3)
        assert np.abs(made[steps] - ref).max() < TOL, steps
    assert np.abs(made[1] - made[8]).max() > 100 * TOL and np.abs(made[2] - made[4]).max() > 100 * TOL


def test_guidance_and_plain_euler_match_diffusers(pipe, reference) -> None:
    """Guidance 3 (CFG on, batched [neg, pos] in diffusers) and use_mean_velocity=False (r = t: our sampler euler,
    and the same keyword): within 1e-4; each moves the frames away from the plain 3-step run."""
    noise = _noise(1)
    plain = _ours(pipe, noise, 3)
    guided = _ours(pipe, noise, 3, guidance=3.0)
    assert np.abs(guided - _diffusers(reference, noise, 3, guidance=3.0)).max() < TOL
    euler = _ours(pipe, noise, 3, sampler="euler")
    assert np.abs(euler - _diffusers(reference, noise, 3, use_mean_velocity=False)).max() < TOL
    np.testing.assert_array_equal(_ours(pipe, noise, 3, use_mean_velocity=False), euler)
    assert min(np.abs(guided - plain).max(), np.abs(euler - plain).max()) > 100 * TOL


def test_continuing_a_video_matches_diffusers(pipe, reference) -> None:
    """The first 5 frames of a video given (2 of 3 latent frames pinned at t = 0, their r as given), with the mean
    velocity and with plain Euler: within 1e-4 of AnyFlowPipeline(video=...); another video gives other frames."""
    from PIL import Image

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (5, H, W, 3), dtype=np.uint8)
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)[None].float() / 255  # diffusers' (B, T, C, H, W) in [0, 1]
    pil = [Image.fromarray(f) for f in frames]
    noise = _noise(2)
    for sampler, mean in (("flowmap", True), ("euler", False)):
        ours = _ours(pipe, noise, 3, video=pil, sampler=sampler)
        ref = _diffusers(reference, noise, 3, video=video, use_mean_velocity=mean)
        assert ours.shape == ref.shape == (1, FRAMES, H, W, 3)
        assert np.abs(ours - ref).max() < TOL, sampler
    other = _ours(pipe, noise, 3, video=pil[::-1])
    assert np.abs(other - ours).max() > 100 * TOL


def test_bundle_defaults_and_what_it_refuses(anyflow: tuple[Path, Path], pipe, tmp_path: Path) -> None:
    """The bundle runs 4 flowmap steps without guidance unless told; unipc and dpm++ (past outputs taken as
    instantaneous velocities), a video that is not 4k+1 first frames, and use_mean_velocity against the sampler
    asked are refused in one line, exit 2, nothing written."""
    from runtime.errors import UserError

    manifest = json.loads((anyflow[1] / "manifest.json").read_text())
    assert manifest["kind"] == "anyflow"
    assert {k: manifest["defaults"][k] for k in ("steps", "guidance", "sampler")} == \
        {"steps": 4, "guidance": 1.0, "sampler": "flowmap"}
    from typing import get_args

    from runtime import samplers
    from runtime.serve import openapi

    # /v1/models documents every sampler a bundle may default to (a flow-map bundle's is flowmap)
    assert set(get_args(openapi.Defaults.model_fields["sampler"].annotation)) == set(samplers.SAMPLERS)
    out = tmp_path / "x.mp4"
    for flags, says in ((["--sampler", "unipc"], "sampler unipc treats past outputs as instantaneous velocities"),
                        (["--sampler", "dpm++"], "sampler dpm++ treats past outputs as instantaneous velocities"),
                        (["--sampler", "flowmap", "--use-mean-velocity", "false"],
                         "use_mean_velocity=False is sampler euler, but sampler flowmap was asked")):
        r = run_cli("runtime", "generate", str(anyflow[1]), "--prompt", PROMPT, "--out", str(out), *flags,
                    check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr
        assert not out.exists()
    with pytest.raises(UserError, match="the video has 4 frames: give the first frames to continue, 4k\\+1"):
        pipe.generate(PROMPT, video=np.zeros((4, H, W, 3), np.uint8), progress=False)
    with pytest.raises(UserError, match="the video has 9 frames: .* fewer than the 9"):
        pipe.generate(PROMPT, video=np.zeros((9, H, W, 3), np.uint8), progress=False)


@pytest.mark.slow
def test_the_14b_from_its_architecture_name_for_tpu(tmp_path: Path) -> None:
    """`--model anyflow-wan2.1-t2v-14b --no-weights` builds the released 14B's programs for tpu-v6e-8 with the TPU
    attention kernel: the kind from the name, the step taking a target timestep per latent frame, the delta embedder
    among the DiT's weights."""
    out = tmp_path / "b"
    run_module("export", "--model", "anyflow-wan2.1-t2v-14b", "--no-weights", "--resolution", "480p", "--frames", "5",
               "--target", "tpu-v6e-8", "--out", str(out), "-q")
    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "anyflow" and m["defaults"]["sampler"] == "flowmap"
    step = m["programs"]["denoise_step"]
    assert step["inputs"]["r_timestep"]["shape"] == [2] and step["inputs"]["condition"]["shape"] == [1, 16, 2, 60, 104]
    assert "condition_embedder.delta_embedder.linear_1.weight" in m["weights"]["transformer"]["tensors"]
    assert m["attention"]["dit"]["impl"] == "pallas-tpu-flash"
