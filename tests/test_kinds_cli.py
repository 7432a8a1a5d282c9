"""Wan 2.2 and image-to-video through the CLI: torch-free generation from an image, the three-stage CLI,
the same frames on 1 and 8 devices, and every bad input as one line that writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .conftest import KIND_CASES, ROOT, devices_env, run_cli, run_module, run_modules, test_image
from .test_bad_input import _fails_cleanly
from .test_torch_free import BLOCKER, _has_pyav, _read_ffmpeg

GEN = ("--prompt", "a robot walking in the city at night", "--steps", "3", "--seed", "5", "-q")


def _frames(path: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(path))["frames"]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("images")
    out = {"first": root / "first.png", "last": root / "last.jpg", "rgba": root / "rgba.png"}
    test_image(70, 50, seed=1).save(out["first"])
    test_image(40, 64, seed=2).save(out["last"], quality=95)
    test_image(70, 50, seed=3, mode="RGBA").save(out["rgba"])
    (root / "notes.png").write_text("not an image")
    out["text"] = root / "notes.png"
    # Lucy Edit's source videos (mp4, another size than the bundle's): 9 frames (a shape's), and 7 (none's)
    from .test_video_in import _mp4, _video

    for name, frames in (("video", 9), ("video7", 7)):
        out[name] = _mp4(_video(frames, 70, 50, seed=frames), root / f"{name}.mp4")
    return out


def test_generate_from_an_image_without_torch(kind_bundles, images, tmp_path: Path) -> None:
    import imageio.v3 as iio

    bundle = kind_bundles["flf2v"]
    out = tmp_path / "video.mp4"
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER, "generate", str(bundle), *GEN, "--image", str(images["first"]),
         "--last-image", str(images["last"]), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = json.loads((bundle / "manifest.json").read_text())["shapes"][0]
    frames = iio.imread(out, plugin="pyav") if _has_pyav() else _read_ffmpeg(out)
    assert frames.shape == (g["frames"], g["height"], g["width"], 3) and frames.std() > 0


def test_three_stage_cli_carries_the_image_conditioning(kind_bundles, images, tmp_path: Path) -> None:
    """encode --image writes the CLIP embeddings, VAE latents and mask; denoise needs no image."""
    bundle = str(kind_bundles["i2v"])
    img = ("--image", str(images["first"]))
    run_module("runtime", "generate", bundle, *GEN, *img, "--out", str(tmp_path / "a.mp4"),
               "--frames-out", str(tmp_path / "a.safetensors"))
    run_module("runtime", "encode", bundle, "--prompt", GEN[1], *img, "--out", str(tmp_path / "e.safetensors"), "-q")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "e.safetensors"), "np") as f:
        assert set(f.keys()) == {"prompt_embeds", "negative_prompt_embeds", "image_embeds", "condition"}
    run_module("runtime", "denoise", bundle, "--embeds", str(tmp_path / "e.safetensors"), *GEN[2:],
               "--out", str(tmp_path / "l.safetensors"))
    run_module("runtime", "decode", bundle, "--latents", str(tmp_path / "l.safetensors"), "--out",
               str(tmp_path / "b.gif"), "--frames-out", str(tmp_path / "b.safetensors"), "-q")
    np.testing.assert_array_equal(_frames(tmp_path / "a.safetensors"), _frames(tmp_path / "b.safetensors"))
    from PIL import Image

    with Image.open(tmp_path / "b.gif") as gif:  # --out .gif writes an animated GIF
        assert gif.n_frames == KIND_CASES["i2v"][2] and gif.size == (48, 32)


@pytest.mark.slow  # 8 devices per kind: test_multidevice covers the mechanism (1, 8 devices, 2 processes)
@pytest.mark.parametrize("kind", ["i2v", "t2v-moe", "lucy-edit"])
def test_same_frames_on_1_and_8_devices(kind: str, kind_bundles, kind_checkpoints, images, tmp_path: Path) -> None:
    _, res, frames, max_len = KIND_CASES[kind]
    cpu8 = tmp_path / "cpu8"
    extra = {"i2v": ("--image", str(images["first"])), "t2v-moe": ("--guidance-2", "2.5"),
             "lucy-edit": ("--video", str(images["video"]))}[kind]  # an mp4 whose 9 frames pick the shape
    run_modules(["export", "--model", str(kind_checkpoints[kind]), "--resolution", res, "--frames", str(frames),
                 "--dtype", "fp32", "--max-sequence-length", str(max_len), "--target", "cpu-8", "--out", str(cpu8),
                 "-q"],
                ["runtime", "generate", str(kind_bundles[kind]), *GEN, *extra, "--out", str(tmp_path / "1.mp4"),
                 "--frames-out", str(tmp_path / "1.safetensors")])
    run_module("runtime", "generate", str(cpu8), *GEN, *extra, "--out", str(tmp_path / "8.mp4"),
               "--frames-out", str(tmp_path / "8.safetensors"),
               env=devices_env(8))
    one, eight = _frames(tmp_path / "1.safetensors"), _frames(tmp_path / "8.safetensors")
    assert np.abs(one - eight).max() <= 1e-5 and one.std() > 1e-3


@pytest.mark.parametrize("kind,args,message", [
    ("t2v-moe", ("--image", "{first}"), "it takes no image"),
    ("i2v", (), "it needs an image (--image FILE"),
    ("i2v", ("--image", "{first}", "--last-image", "{last}"), "it takes no last image"),
    ("flf2v", ("--image", "{first}"), "it needs a last image too"),
    ("ti2v", ("--last-image", "{last}"), "it takes no last image"),
    ("i2v", ("--image", "{first}", "--guidance-2", "2"), "guidance_2 (--guidance-2) is for two-expert models"),
    ("i2v", ("--image", "{text}"), "--image: cannot read"),
    ("i2v", ("--image", "{missing}"), "--image: file not found"),
    ("i2v", ("--image", "{first}", "--flow-shift", "1e-30"), "flow shift 1e-30 gives an unusable"),
    ("i2v", ("--image", "{first}", "--fps", "0"), "fps must be an integer >= 1, got 0"),
    ("i2v", ("--image", "{first}", "--out-name", "video.avi"), "cannot write video format '.avi'"),
    ("lucy-edit", (), "this bundle is Lucy Edit (video editing from an instruction): it needs a source video "
                      "(--video FILE"),
    ("lucy-edit", ("--video", "{video7}"), "the video has 7 frames; this bundle makes 5 or 9 (its shapes: 64x32 x 9 "
                                           "frames"),
    ("lucy-edit", ("--video", "{video}", "--frames", "5"), "the video has 9 frames but frames=5 was asked"),
    ("lucy-edit", ("--video", "{video}", "--image", "{first}"), "it takes no image"),
    ("lucy-edit", ("--video", "{video}", "--mask", "{video}"), "it takes no mask"),
    ("lucy-edit", ("--video", "{video}", "--strength", "0.5"), "strength is for video-to-video"),
])
def test_bad_input_is_one_line_and_writes_nothing(kind: str, args: tuple, message: str, kind_bundles, images,
                                                  tmp_path: Path) -> None:
    paths = {**{k: str(v) for k, v in images.items()}, "missing": str(tmp_path / "nope.png")}
    args = [a.format(**paths) for a in args]
    name = "video.mp4"
    if "--out-name" in args:
        name = args.pop(args.index("--out-name") + 1)
        args.remove("--out-name")
    proc = run_cli("runtime", "generate", str(kind_bundles[kind]), *GEN, *args, "--out", str(tmp_path / name),
                      check=False)
    _fails_cleanly(proc, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_guidance_2_for_a_wan21_bundle_and_an_image_for_text_only(fp32_bundles, images, tmp_path: Path) -> None:
    bundle = str(fp32_bundles["tiny-64x32-f9"])
    proc = run_cli("runtime", "generate", bundle, *GEN, "--guidance-2", "3", "--out", str(tmp_path / "v.mp4"),
                      check=False)
    _fails_cleanly(proc, "is for two-expert models")
    proc = run_cli("runtime", "encode", bundle, "--prompt", "x", "--image", str(images["first"]),
                      "--out", str(tmp_path / "e.safetensors"), check=False)
    _fails_cleanly(proc, "it takes no image")
    assert list(tmp_path.iterdir()) == []
