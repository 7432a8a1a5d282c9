"""One bundle, several shapes: every shape of a multi-shape bundle makes what a bundle of that shape alone makes,
bit for bit, from one copy of the weights; portrait shapes match diffusers; a shape the bundle lacks is one line.

The bundle (conftest.SHAPES_CASE) is the tiny Wan 2.1 model at 64x32 and 32x64 (portrait) x 9 and 5 frames; its
default shape is the first.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import manifest as mf

from .conftest import KIND_CASES, SHAPES_CASE, devices_env, in_parallel, run_cli, run_module, run_modules, test_image

PROMPT = "a red fox running through snow, cinematic"
NEGATIVE = "blurry"
SHAPES = [(64, 32, 9), (64, 32, 5), (32, 64, 9), (32, 64, 5)]


@pytest.fixture(scope="module")
def single_bundles(checkpoints, fp32_bundles, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    """A one-shape bundle of each shape (the default one is conftest's tiny-64x32-f9)."""
    variant, _, _, max_len = SHAPES_CASE
    root = tmp_path_factory.mktemp("single")
    out = {shape: root / f"{shape[0]}x{shape[1]}x{shape[2]}" for shape in SHAPES[1:]}
    run_modules(*[["export", "--model", str(checkpoints[variant]), "--resolution", f"{w}x{h}", "--frames", str(f),
                   "--dtype", "fp32", "--max-sequence-length", str(max_len), "--out", str(path), "-q"]
                  for (w, h, f), path in out.items()])
    return {SHAPES[0]: fp32_bundles["tiny-64x32-f9"], **out}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_lists_the_shapes_and_one_copy_of_the_weights(shapes_bundle: Path, single_bundles) -> None:
    m = mf.read(shapes_bundle)
    assert [g.shape for g in m.shapes] == SHAPES and m.geometry.shape == SHAPES[0]
    assert sorted(m.programs) == sorted(m.stages(short_prompts=True))
    one = mf.read(single_bundles[SHAPES[0]])
    # the same weight files, byte for byte, whatever the number of shapes
    assert {g: w.sha256 for g, w in m.weights.items()} == {g: w.sha256 for g, w in one.weights.items()}
    assert sorted(p.name for p in (shapes_bundle / "weights").iterdir()) == sorted(
        p.name for p in (single_bundles[SHAPES[0]] / "weights").iterdir())
    # what does not depend on the shape is there once; the VAE once per width x height; the DiT once per shape
    assert "text_encoder@32x64x9" not in m.programs and "cross_kv@32x64x9" not in m.programs
    assert {n for n in m.programs if n.startswith("vae_decode_first")} == {"vae_decode_first",
                                                                         "vae_decode_first@32x64"}
    # each shape's programs are the one-shape bundle's programs, byte for byte
    for shape, single in single_bundles.items():
        s = mf.read(single)
        g = m.find_shape(*shape)
        for name, spec in s.programs.items():
            mine = m.programs[m.program_for(name, g)]
            assert [_sha(shapes_bundle / f.file) for f in mine.files()] == [_sha(single / f.file)
                                                                           for f in spec.files()], name


def test_each_shape_makes_what_its_one_shape_bundle_makes(shapes_bundle: Path, single_bundles) -> None:
    pipe = runtime.load(shapes_bundle)
    assert pipe.shapes == SHAPES
    for shape, single in single_bundles.items():
        w, h, f = shape
        ours = pipe.generate(PROMPT, NEGATIVE, size=f"{w}x{h}", frames=f, seed=3, steps=2, progress=False)
        theirs = runtime.load(single).generate(PROMPT, NEGATIVE, seed=3, steps=2, progress=False)
        assert ours.shape == (1, f, h, w, 3)
        np.testing.assert_array_equal(ours, theirs)
    # denoise and decode take the shape of the latents they are given
    tall = pipe.shape("32x64", 5)
    init = pipe.initial_latents(3, tall)
    embeds = pipe.encode(PROMPT, NEGATIVE)
    latents = pipe.denoise(embeds, steps=2, latents=init, progress=False)
    assert latents.shape == tall.latent_shape
    np.testing.assert_array_equal(pipe.decode(latents),
                                  pipe.generate(PROMPT, NEGATIVE, size=(32, 64), frames=5, seed=3, steps=2,
                                                progress=False))


def test_a_shape_the_bundle_lacks_is_a_user_error_naming_its_shapes(shapes_bundle: Path) -> None:
    pipe = runtime.load(shapes_bundle)
    listed = "64x32 x 9 frames (default), 64x32 x 5 frames, 32x64 x 9 frames, 32x64 x 5 frames"
    for kwargs, asked in ((dict(size="48x48"), "48x48 x 9 frames"), (dict(frames=13), "64x32 x 13 frames"),
                          (dict(size="32x64", frames=1), "32x64 x 1 frames")):
        with pytest.raises(runtime.UserError) as e:
            pipe.generate(PROMPT, steps=1, progress=False, **kwargs)
        assert str(e.value) == (f"this bundle makes no {asked} video: its shapes are {listed} (export one with "
                                "--resolution/--frames for others)")
    with pytest.raises(runtime.UserError, match="is not WIDTHxHEIGHT"):
        pipe.shape("tall")
    with pytest.raises(runtime.UserError, match=r"latents have shape \[1, 16, 2, 4, 4\], this bundle needs one of"):
        pipe.decode(np.zeros((1, 16, 2, 4, 4), np.float32))
    with pytest.raises(runtime.UserError, match="not the size/frames asked for"):
        pipe.denoise(pipe.encode(PROMPT), latents=pipe.initial_latents(0), size="32x64", progress=False)


def test_cli_size_and_frames_and_the_error_for_a_missing_shape(shapes_bundle: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    out, frames = tmp_path / "tall.mp4", tmp_path / "tall.safetensors"
    missing = tmp_path / "missing.mp4"
    ok, bad = in_parallel(
        lambda: run_module("runtime", "generate", str(shapes_bundle), "--prompt", PROMPT, "--size", "32x64",
                           "--frames", "5", "--steps", "2", "--out", str(out), "--frames-out", str(frames), "-q"),
        lambda: run_module("runtime", "generate", str(shapes_bundle), "--prompt", PROMPT, "--size", "64x64",
                           "--steps", "2", "--out", str(missing), check=False))
    assert load_file(str(frames))["frames"].shape == (1, 5, 64, 32, 3) and out.is_file()
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == ("error: this bundle makes no 64x64 x 9 frames video: its shapes are 64x32 x 9 "
                                  "frames (default), 64x32 x 5 frames, 32x64 x 9 frames, 32x64 x 5 frames (export "
                                  "one with --resolution/--frames for others)")
    assert not missing.exists() and not list(tmp_path.glob(".missing*"))
    # decode picks the shape from the latents file
    pipe = runtime.load(shapes_bundle)
    from runtime import intermediates as im

    latents = pipe.initial_latents(1, pipe.shape("32x64", 9))
    im.save(tmp_path / "latents.safetensors", im.LATENTS, {"latents": latents}, pipe.bundle_id, {})
    run_module("runtime", "decode", str(shapes_bundle), "--latents", str(tmp_path / "latents.safetensors"),
               "--out", str(tmp_path / "d.mp4"), "--frames-out", str(tmp_path / "d.safetensors"), "-q")
    np.testing.assert_allclose(load_file(str(tmp_path / "d.safetensors"))["frames"], pipe.decode(latents), atol=1e-6)


def test_inspect_and_verify_show_the_shapes(shapes_bundle: Path) -> None:
    import json

    summary = json.loads(run_cli("runtime", "inspect", str(shapes_bundle), "--json").stdout)
    assert [(s["width"], s["height"], s["frames"], s["default"]) for s in summary["shapes"]] == [
        (*s, i == 0) for i, s in enumerate(SHAPES)]
    text = run_cli("runtime", "inspect", str(shapes_bundle)).stdout
    assert "shapes     4: 64x32 x 9 frames (0.5625 s) default, 64x32 x 5 frames (0.3125 s), 32x64 x 9" in text
    proc = run_cli("runtime", "verify", str(shapes_bundle))
    assert "shapes: 4 (64x32 x 9 frames (default), 64x32 x 5 frames, 32x64 x 9 frames, 32x64 x 5 frames)" in proc.stdout


def test_export_flags_bad_lists_and_a_shape_the_mesh_cannot_divide(checkpoints, tmp_path: Path) -> None:
    model = str(checkpoints["tiny"])
    cases = [
        (("--resolution", "64x32,32x64,64x32"), "--resolution lists 64x32 twice"),
        (("--resolution", "64x32", "--frames", "9,10"), "--frames 10 is not of the form 4k+1 (try 9 or 13)"),
        (("--resolution", "64x32", "--frames", "9,x"), "is not a frame count or a comma-separated list"),
        # 16x16 x 1 frame is one token per frame stack: it cannot split over sp=2
        (("--resolution", "64x32,16x16", "--frames", "1", "--target", "cpu-8"),
         "at 16x16 x 1 frames: its 1 tokens per frame stack do not divide over sp=2"),
    ]
    procs = in_parallel(*[lambda a=args: run_module("export", "--model", model, *a, "--out", str(tmp_path / "b"),
                                                    check=False) for args, _ in cases])
    for (args, message), proc in zip(cases, procs):
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists() and not list(tmp_path.iterdir())


def test_portrait_shape_matches_diffusers_wan21(shapes_bundle: Path, checkpoints) -> None:
    import torch
    from diffusers import WanPipeline

    pipe = runtime.load(shapes_bundle)
    tall = pipe.shape("32x64", 9)
    init = pipe.initial_latents(5, tall)
    frames = pipe.generate(PROMPT, NEGATIVE, size="32x64", frames=9, seed=5, steps=3, guidance=5.0, progress=False)
    ref = WanPipeline.from_pretrained(str(checkpoints["tiny"]), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, height=64, width=32, num_frames=9, num_inference_steps=3,
                   guidance_scale=5.0, max_sequence_length=SHAPES_CASE[3], latents=torch.from_numpy(init.copy()),
                   output_type="np").frames
    assert frames.shape == want.shape == (1, 9, 64, 32, 3)
    assert np.abs(frames - want).max() <= 1e-4 and frames.std() > 1e-3


# flf2v: the slow tier's, another kind of the same path (its conditioning video, frame mask and CLIP at the default
# shape against diffusers in test_kinds)
@pytest.mark.parametrize("kind,size", [("ti2v", "64x96"), pytest.param("flf2v", "32x64", marks=pytest.mark.slow)])
def test_portrait_shape_of_an_image_kind_matches_diffusers(kind: str, size: str, kind_bundles,
                                                           kind_checkpoints) -> None:
    """The image conditioning at a bundle's portrait shape, against WanImageToVideoPipeline: Wan 2.2 TI2V-5B (the
    VAE encoder of that size, the first frame's per-token timesteps) and (the slow tier) Wan 2.1 FLF2V (CLIP, the
    conditioning video of first and last frame, its frame mask)."""
    import torch
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline

    assert size in KIND_CASES[kind][1].split(",")[1:]  # not the default shape
    pipe = runtime.load(kind_bundles[kind])
    tall = pipe.shape(size)
    images = {"image": test_image(50, 70, seed=6)}
    if kind == "flf2v":
        images["last_image"] = test_image(40, 64, seed=7)
    init = pipe.initial_latents(8, tall)
    frames = pipe.generate(PROMPT, NEGATIVE, size=size, seed=8, steps=3, guidance=5.0, progress=False, **images)
    ckpt = str(kind_checkpoints[kind])
    vae = AutoencoderKLWan.from_pretrained(ckpt, subfolder="vae", dtype=torch.float32)
    ref = WanImageToVideoPipeline.from_pretrained(ckpt, vae=vae, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = ref(**images, prompt=PROMPT, negative_prompt=NEGATIVE, height=tall.height, width=tall.width,
                   num_frames=tall.frames, num_inference_steps=3, guidance_scale=5.0,
                   max_sequence_length=tall.max_sequence_length, latents=torch.from_numpy(init.copy()),
                   output_type="np").frames
    assert frames.shape == want.shape == (1, tall.frames, tall.height, tall.width, 3)
    assert np.abs(frames - want).max() <= 1e-4 and frames.std() > 1e-3


@pytest.mark.slow  # a variant on 8 devices: test_serve's two-process mesh runs the portrait shape on 2 x 4
def test_portrait_shape_on_8_devices_equals_one_device(shapes_bundle: Path, cpu8_bundle: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    out = tmp_path / "eight.safetensors"
    run_module("runtime", "generate", str(cpu8_bundle), "--prompt", PROMPT, "--size", "32x64", "--steps", "2",
               "--seed", "4", "--out", str(tmp_path / "eight.mp4"), "--frames-out", str(out), "-q",
               env=devices_env(8))
    one = runtime.load(shapes_bundle).generate(PROMPT, size="32x64", frames=9, seed=4, steps=2, progress=False)
    eight = load_file(str(out))["frames"]
    assert eight.shape == one.shape == (1, 9, 64, 32, 3)
    assert np.abs(eight - one).max() <= 1e-5
