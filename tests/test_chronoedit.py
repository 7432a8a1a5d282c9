"""ChronoEdit (issue 63): an image edited as a short video whose last frame is the edit (runtime/chronoedit.py), against
diffusers' ChronoEditPipeline on the same tiny random model (ChronoEditTransformer3DModel: 2 latent frames at temporal
RoPE positions 0 and 7), fp32, the same initial noise. One bundle of both shapes, 64x32 x 5 frames (the edit's 2
latent frames) and x 9 frames (3 latent frames to reason over), serves every test here."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from .conftest import ROOT, run_cli, run_module, shared, test_image

torch = pytest.importorskip("torch")

W, H, EDIT, REASON = 64, 32, 5, 9  # pixels; the edit's frames and the reasoning shape's
TOL = 1e-4  # the issue's: frames within 1e-4 of diffusers in fp32
PROMPT, NEGATIVE = "a red cat", "blurry"
GOLDEN = ROOT / "artifacts" / "golden" / "schema-10" / "bundle"  # a text-to-video bundle


@pytest.fixture(scope="module")
def chronoedit() -> tuple[Path, Path]:
    """(the tiny ChronoEdit checkpoint in diffusers format, its fp32 bundle of both shapes)."""
    from export import tiny

    ckpt = shared("chronoedit-checkpoint", lambda root: tiny.save("tiny-chronoedit", root / "ckpt")) / "ckpt"
    bundle = shared("chronoedit-bundle", lambda root: run_module(
        "export", "--model", str(ckpt), "--resolution", f"{W}x{H}", "--frames", f"{EDIT},{REASON}", "--dtype", "fp32",
        "--max-sequence-length", "8", "--out", str(root / "bundle"), "-q"))
    return ckpt, bundle / "bundle"


@pytest.fixture(scope="module")
def pipe(chronoedit: tuple[Path, Path]):  # noqa: ANN201
    import runtime

    return runtime.load(chronoedit[1])


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image to edit, as a PNG of another size than the bundle's (resized as the pipeline does)."""
    path = tmp_path_factory.mktemp("chronoedit") / "in.png"
    test_image(70, 50, seed=1).save(path)
    return path


def _noise(frames: int, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, (frames - 1) // 4 + 1, H // 8, W // 8, generator=g).numpy()


def _diffusers(ckpt: Path, image: Path, noise: np.ndarray, frames: int, k: int) -> np.ndarray:
    """ChronoEditPipeline's frames with `noise` as its initial latents (temporal reasoning over `frames` for k > 0)."""
    from diffusers import ChronoEditPipeline
    from PIL import Image

    ref = ChronoEditPipeline.from_pretrained(str(ckpt), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return ref(image=Image.open(image), prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W,
                   num_frames=frames, num_inference_steps=3, guidance_scale=5.0, latents=torch.from_numpy(noise.copy()),
                   max_sequence_length=8, output_type="np", enable_temporal_reasoning=k > 0,
                   num_temporal_reasoning_steps=k).frames


@pytest.mark.parametrize("k, frames", [(0, EDIT), (1, REASON)])
def test_matches_diffusers(chronoedit: tuple[Path, Path], pipe, source: Path, k: int, frames: int) -> None:
    """A plain edit (every step on the 2 latent frames) and temporal reasoning (1 of 3 steps over 9 frames' 3 latent
    frames, then the state's and condition's latent frames [0, -1] for the other 2): the 5 frames within 1e-4 of
    ChronoEditPipeline's with the same initial noise."""
    assert pipe.kind.name == "chronoedit" and pipe.shapes == [(W, H, EDIT), (W, H, REASON)]
    noise = _noise(frames)
    ours = pipe.generate(PROMPT, NEGATIVE, image=source, steps=3, guidance=5.0, latents=noise, progress=False,
                         temporal_reasoning_steps=k)
    ref = _diffusers(chronoedit[0], source, noise, frames, k)
    assert ours.shape == ref.shape == (1, EDIT, H, W, 3)
    assert np.abs(ours - ref).max() < TOL
    assert ours.std() > 1e-3  # not trivially equal
    if k:  # the reasoning frames moved the edit: the same 2 latent frames' noise without them ends elsewhere
        plain = pipe.generate(PROMPT, NEGATIVE, image=source, steps=3, guidance=5.0, latents=noise[:, :, [0, -1]],
                              progress=False)
        assert np.abs(plain - ours).max() > 100 * TOL


def test_the_edited_image_is_the_last_frame(chronoedit: tuple[Path, Path], pipe, source: Path,
                                            tmp_path: Path) -> None:
    """`runtime generate --out x.png` writes the last frame at the bundle shape's size, as `edit_image` returns it
    and `--out x.mp4` holds the 5 frames it ends; with --temporal-reasoning-steps over --frames 9 too."""
    from PIL import Image

    from runtime.video import to_uint8

    bundle = str(chronoedit[1])
    reasoning = {"temporal_reasoning_steps": 1, "frames": REASON}
    for extra, kwargs in (([], {"steps": 1}),
                          (["--temporal-reasoning-steps", "1", "--frames", str(REASON)], {"steps": 2, **reasoning})):
        out = tmp_path / f"edited{len(extra)}.png"
        run_cli("runtime", "generate", bundle, "--image", str(source), "--prompt", PROMPT, "--steps",
                str(kwargs["steps"]), "-q", "--seed", "3", "--out", str(out), *extra)
        written = Image.open(out)
        assert written.size == (W, H) and written.mode == "RGB"
        edited = pipe.edit_image(source, PROMPT, seed=3, progress=False, **kwargs)
        assert edited.size == (W, H) and np.array_equal(np.asarray(edited), np.asarray(written))
        if not extra:  # the last of the frames generate returns
            frames = pipe.generate(PROMPT, image=source, seed=3, progress=False, **kwargs)
            np.testing.assert_array_equal(np.asarray(written), to_uint8(frames[0, -1]))
    video = tmp_path / "edited.mp4"
    run_cli("runtime", "generate", bundle, "--image", str(source), "--prompt", PROMPT, "--steps", "1", "-q",
            "--out", str(video))
    import imageio.v2 as imageio

    assert len(imageio.mimread(str(video))) == EDIT


def test_refusals_are_one_line_and_write_nothing(chronoedit: tuple[Path, Path], pipe, source: Path,
                                                tmp_path: Path) -> None:
    """Temporal reasoning with another sampler than UniPC (whose history it trims), with as many reasoning steps as
    steps, over a frame count the bundle lacks; reasoning frames without temporal reasoning; a .png out or
    temporal reasoning for a video bundle, edit_image on one; an export without the edit's 5 frames: one line each,
    exit 2, nothing written."""
    from runtime.errors import UserError

    bundle = str(chronoedit[1])
    cases = [(["--temporal-reasoning-steps", "1", "--sampler", "euler"],
              "error: temporal reasoning trims UniPC's history (diffusers' ChronoEditPipeline reads "
              "scheduler.model_outputs): it runs with sampler unipc, not euler"),
             (["--temporal-reasoning-steps", "3", "--steps", "3"],
              "error: temporal_reasoning_steps 3 must be fewer than the 3 steps"),
             (["--temporal-reasoning-steps", "1", "--frames", "13"], "error: this bundle makes no 64x32 x 13 frames "
                                                                      "video: its shapes are"),
             (["--frames", str(REASON)], "error: ChronoEdit edits on 5 frames; 9 frames are for temporal reasoning")]
    for name in ("x.png", "x.mp4"):
        for extra, message in cases:
            out = tmp_path / name
            proc = run_cli("runtime", "generate", bundle, "--image", str(source), "--prompt", PROMPT, "--steps", "2",
                           "--out", str(out), *extra, check=False)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
            assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(UserError, match=re.escape("it runs with sampler unipc, not dpm++")):
        pipe.edit_image(source, PROMPT, steps=2, temporal_reasoning_steps=1, sampler="dpm++", progress=False)
    for extra, message in ((["--out", str(tmp_path / "x.png")], "it makes videos, and x.png names an image"),
                           (["--temporal-reasoning-steps", "1", "--out", str(tmp_path / "x.mp4")],
                            "temporal_reasoning_steps is for ChronoEdit models")):
        proc = run_cli("runtime", "generate", str(GOLDEN), "--prompt", PROMPT, *extra, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and message in proc.stderr.strip(), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())
    import runtime

    with pytest.raises(UserError, match=re.escape("edit_image is for image-editing models (ChronoEdit)")):
        runtime.load(GOLDEN).edit_image(source, PROMPT)
    out = tmp_path / "nine"  # an export without the edit's shape, where every run ends
    proc = run_module("export", "--model", str(chronoedit[0]), "--resolution", f"{W}x{H}", "--frames", str(REASON),
                      "--out", str(out), "-q", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not out.exists()
    assert proc.stderr.strip().splitlines()[-1] == ("error: ChronoEdit edits on 5 frames (2 latent frames), where "
                                                    "every run ends: --frames 9 lacks 5 (add it: --frames 5,9)")


def test_detected_from_its_pipeline_or_transformer_and_its_architecture_name() -> None:
    """A ChronoEditPipeline, or an I2V pipeline whose transformer is a ChronoEditTransformer3DModel, is the chronoedit
    kind (refused without CLIP); `chronoedit-14b` is the released 14B's DiT: Wan2.1-I2V-14B's widths and
    rope_temporal_skip_len 8."""
    from export import source
    from runtime.errors import UserError

    chrono = {"_class_name": "ChronoEditTransformer3DModel"}
    assert source.detect_kind("ChronoEditPipeline", False, False, {}, True, "x") == "chronoedit"
    assert source.detect_kind("WanImageToVideoPipeline", False, False, chrono, True, "x") == "chronoedit"
    with pytest.raises(UserError, match="ChronoEdit with two experts or without a CLIP image_encoder"):
        source.detect_kind("ChronoEditPipeline", False, False, chrono, False, "x")
    src = source.load("chronoedit-14b", "bf16", weights=False)
    t = src.transformer_config
    assert src.model_kind == "chronoedit" and t["_class_name"] == "ChronoEditTransformer3DModel"
    assert (t["rope_temporal_skip_len"], t["num_layers"], t["num_attention_heads"], t["in_channels"],
            t["image_dim"]) == (8, 40, 40, 36, 1280)
    i2v = source.load("wan2.1-i2v-14b-720p", "bf16", weights=False).transformer_config
    assert {k: v for k, v in t.items() if k not in ("_class_name", "rope_temporal_skip_len")} == \
        {k: v for k, v in i2v.items() if k != "_class_name"}


@pytest.mark.slow
def test_programs_from_the_architecture_name(tmp_path: Path) -> None:
    """`--model chronoedit-14b --no-weights --target tpu-v6e-8` traces the released 14B's programs (on meta, no
    download) for the edit's 5 frames and 29 to reason over, at 720p: a chronoedit bundle of both shapes, its DiT taking
    the 20 channels of mask and image latents beside the noise."""
    import runtime.manifest as mf

    out = tmp_path / "chronoedit-14b"
    run_module("export", "--model", "chronoedit-14b", "--no-weights", "--resolution", "1280x720", "--frames", "5,29",
               "--target", "tpu-v6e-8", "--out", str(out), "-q")
    m = mf.read(out)
    assert m.kind == "chronoedit" and [g.shape for g in m.shapes] == [(1280, 720, 5), (1280, 720, 29)]
    assert not m.has_weights
    assert m.programs["denoise_step"].inputs["condition"].shape[1] == 4 + 16
