"""runtime.images against the real preprocessing: diffusers' VideoProcessor and transformers' CLIP image processor."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runtime.errors import UserError
from runtime.images import clip_config, clip_pixels, load_image, vae_pixels

# The official Wan2.1 I2V image_processor/preprocessor_config.json (minus image_processor_type).
WAN_CLIP = {"crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True,
            "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 224}}

# (width, height): landscape, portrait, odd, exactly the 224 crop, smaller than the crop
SIZES = [(640, 480), (480, 832), (301, 167), (224, 224), (40, 23)]


def rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise, so resampling filters and off-by-one crops both show."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / max(width - 1, 1), yy * 255 / max(height - 1, 1), (xx + yy) % 256], axis=-1)
    noisy = base + rng.normal(0, 25, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


@pytest.mark.parametrize("src,dst", [((64, 48), (64, 48)), ((40, 24), (96, 64)), ((200, 120), (64, 48)),
                                     ((90, 160), (128, 64)), ((77, 51), (104, 72))])
@pytest.mark.parametrize("resample", ["lanczos", "bicubic"])
def test_vae_pixels_matches_diffusers(src: tuple[int, int], dst: tuple[int, int], resample: str) -> None:
    from diffusers.video_processor import VideoProcessor

    image = rgb(*src, seed=src[0])
    want = VideoProcessor(vae_scale_factor=8, resample=resample).preprocess(image, height=dst[1], width=dst[0])
    got = vae_pixels(image, width=dst[0], height=dst[1], resample=resample)
    assert got.dtype == np.float32 and got.shape == (3, dst[1], dst[0])
    np.testing.assert_allclose(got, want[0].numpy(), rtol=0, atol=1e-6)  # measured: exactly 0
    assert got.min() >= -1 and got.max() <= 1


def test_vae_pixels_floors_to_scale_factor() -> None:
    from diffusers.video_processor import VideoProcessor

    image = rgb(50, 30)
    want = VideoProcessor(vae_scale_factor=8).preprocess(image, height=70, width=100)  # -> 64 x 96
    got = vae_pixels(image, width=100, height=70, vae_scale_factor=8)
    assert got.shape == (3, 64, 96)
    np.testing.assert_allclose(got, want[0].numpy(), rtol=0, atol=1e-6)


def reference_clip(tmp_path: Path, **kwargs):
    """Saved and reloaded like diffusers' pipeline loader does with the checkpoint's image_processor folder."""
    from transformers import AutoImageProcessor, CLIPImageProcessor

    CLIPImageProcessor(**kwargs).save_pretrained(tmp_path / "image_processor")
    processor = AutoImageProcessor.from_pretrained(tmp_path / "image_processor")
    # Without torchvision transformers falls back to the Pillow backend, which clip_pixels reproduces.
    assert type(processor).__name__ == "CLIPImageProcessorPil", type(processor)
    assert type(CLIPImageProcessor.from_pretrained(tmp_path / "image_processor")) is type(processor)
    config = json.loads((tmp_path / "image_processor" / "preprocessor_config.json").read_text())
    return processor, config


@pytest.mark.parametrize("kwargs", [WAN_CLIP, {"size": 32, "crop_size": 32},
                                    {"size": {"height": 20, "width": 40}, "crop_size": 32, "resample": 2},
                                    {"size": 48, "do_center_crop": False, "do_normalize": False}],
                         ids=["wan", "tiny", "pad", "nocrop"])
def test_clip_pixels_matches_transformers(tmp_path: Path, kwargs: dict) -> None:
    processor, saved = reference_clip(tmp_path, **kwargs)
    images = [rgb(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    for config in (saved, kwargs, clip_config(saved)):
        for image in images:  # one at a time: without center crop the shapes differ
            want = processor(images=image, return_tensors="pt")["pixel_values"].numpy()
            got = clip_pixels([image], config)
            assert got.dtype == np.float32 and got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # measured: exactly 0
    if kwargs.get("do_center_crop", True):
        want = processor(images=images, return_tensors="pt")["pixel_values"].numpy()
        np.testing.assert_array_equal(clip_pixels(images, saved), want)


def test_clip_pixels_converts_like_transformers(tmp_path: Path) -> None:
    processor, saved = reference_clip(tmp_path, **WAN_CLIP)
    rgba = rgb(300, 200).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(300, dtype=np.uint8)[None], (200, 1))))
    for image in (rgba, rgb(250, 260).convert("L")):
        want = processor(images=image, return_tensors="pt")["pixel_values"].numpy()
        np.testing.assert_array_equal(clip_pixels([image], saved), want)


def test_clip_config_canonical() -> None:
    canon = clip_config({**WAN_CLIP, "image_processor_type": "CLIPImageProcessor", "processor_class": "X"})
    assert canon == WAN_CLIP
    assert clip_config(canon) == canon and json.loads(json.dumps(canon)) == canon
    assert clip_config({}) == WAN_CLIP  # CLIP's defaults are the Wan values
    assert clip_config({"size": 32, "crop_size": 32})["size"] == {"shortest_edge": 32}
    assert clip_config({"size": [20, 40]})["size"] == {"height": 20, "width": 40}
    for bad in ({"size": {"longest_edge": 3}}, {"crop_size": {"shortest_edge": 3}}, {"resample": 9},
                {"image_mean": [0.5, 0.5]}, {"size": "big"}):
        with pytest.raises(UserError, match="image processor config"):
            clip_config(bad)


def transparent_p() -> Image.Image:
    image = rgb(30, 20).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    image.info["transparency"] = 3
    return image


@pytest.mark.parametrize("make", [
    lambda: rgb(30, 20),
    lambda: Image.merge("RGBA", [*rgb(30, 20).split(), rgb(30, 20, seed=1).convert("L")]),
    lambda: Image.merge("LA", [rgb(30, 20).convert("L"), rgb(30, 20, seed=1).convert("L")]),
    lambda: rgb(30, 20).convert("L"),
    lambda: rgb(30, 20).convert("1"),
    lambda: rgb(30, 20).convert("P", palette=Image.Palette.ADAPTIVE, colors=16),
    transparent_p,
    lambda: rgb(30, 20).convert("CMYK"),
], ids=["RGB", "RGBA", "LA", "L", "1", "P", "P-transparent", "CMYK"])
def test_load_image_converts_like_transformers(make, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from transformers.image_transforms import convert_to_rgb

    image = make()
    want = convert_to_rgb(image, return_numpy=True)
    with caplog.at_level(logging.INFO, logger="runtime"):
        got = load_image(image, what="--image")
    assert got.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(got), want)
    assert ("converting" in caplog.text) == (image.mode != "RGB")
    if image.mode != "CMYK":  # through a PNG file too
        image.save(tmp_path / "in.png")
        np.testing.assert_array_equal(np.asarray(load_image(tmp_path / "in.png")), want)
        np.testing.assert_array_equal(np.asarray(load_image(str(tmp_path / "in.png"))), want)


def test_load_image_array() -> None:
    array = np.asarray(rgb(31, 17))
    got = load_image(array)
    assert got.mode == "RGB" and got.size == (31, 17)
    np.testing.assert_array_equal(np.asarray(got), array)
    np.testing.assert_array_equal(np.asarray(load_image(array[:, ::-1])), array[:, ::-1])  # non-contiguous


def test_load_image_errors(tmp_path: Path) -> None:
    (tmp_path / "x.png").write_text("not an image\n")
    rgb(64, 64).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    cases = [
        (tmp_path / "missing.png", "not found"),
        (tmp_path, "not a file"),
        (tmp_path / "x.png", "cannot read"),
        (str(tmp_path / "cut.png"), "cannot read"),
        (np.zeros((8, 8, 3), np.float32), "uint8"),
        (np.zeros((8, 8, 4), np.uint8), r"\(8, 8, 4\)"),
        (np.zeros((8, 8), np.uint8), "shape"),
        (5, "got int"),
    ]
    for value, problem in cases:
        with pytest.raises(UserError, match=problem) as info:
            load_image(value, what="--image")
        message = str(info.value)
        assert message.startswith("--image: ") and "\n" not in message, message
