"""Input image loading and the two image preprocessings of Wan I2V, without torch.

`vae_pixels` reproduces diffusers' `VideoProcessor.preprocess` (the image the VAE encodes) and `clip_pixels`
reproduces transformers' Pillow-backed CLIP image processor (`CLIPImageProcessorPil`, what `AutoImageProcessor`
gives when torchvision is absent); tests/test_images.py checks both against the real libraries.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import UserError

log = logging.getLogger("runtime")

# diffusers.utils.pil_utils.PIL_INTERPOLATION
_VAE_RESAMPLE = {
    "linear": Image.Resampling.BILINEAR,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "nearest": Image.Resampling.NEAREST,
}

# CLIPImageProcessorPil's class defaults: a key missing (or None) in preprocessor_config.json means these.
_CLIP_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "size": {"shortest_edge": 224},
    "resample": int(Image.Resampling.BICUBIC),
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def _to_rgb(image: Image.Image, what: str) -> Image.Image:
    """transformers' `convert_to_rgb`: transparency is composited over white, anything else is `convert("RGB")`."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if image.mode == "RGB" and not has_alpha:
        return image
    log.info("%s: converting %s image to RGB%s", what, image.mode,
             " (transparency composited over white)" if has_alpha else "")
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def load_image(image: Image.Image | str | os.PathLike | np.ndarray, what: str = "image") -> Image.Image:
    """A PIL image, a path to an image file, or a uint8 (H, W, 3) array, as an RGB PIL image.

    Raises UserError (one line, naming `what`) for anything that is not a readable image.
    """
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
            hint = ("drop alpha with a[..., :3] or pass the PIL image" if image.dtype == np.uint8 else
                    "for floats in [0, 1] use np.clip(a * 255, 0, 255).round().astype(np.uint8)")
            raise UserError(f"{what}: expected a uint8 array of shape (height, width, 3) with RGB values 0-255, "
                            f"got {image.dtype} of shape {image.shape}; {hint}")
        return Image.fromarray(np.ascontiguousarray(image))
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.exists():
            raise UserError(f"{what}: file not found: {path}; check the path")
        if not path.is_file():
            raise UserError(f"{what}: {path} is not a file; give the path of an image file (PNG, JPEG, ...)")
        try:
            with Image.open(path) as opened:
                opened.load()  # decode now, so truncated or corrupt files fail here and not later
                # As diffusers.utils.load_image: honour the EXIF orientation (phone photos).
                return _to_rgb(ImageOps.exif_transpose(opened), what)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise UserError(f"{what}: cannot read {path} as an image ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'unreadable'}); "
                            f"give a valid image file (PNG, JPEG, ...)") from None
    if isinstance(image, Image.Image):
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as e:
            raise UserError(f"{what}: the image cannot be decoded ({type(e).__name__}: {e}); "
                            f"give a valid image") from None
        return _to_rgb(image, what)
    raise UserError(f"{what}: expected a PIL image, a path to an image file or a uint8 (height, width, 3) array, "
                    f"got {type(image).__name__}")


def vae_pixels(image: Image.Image, width: int, height: int, resample: str = "lanczos", *,
               vae_scale_factor: int = 1) -> np.ndarray:
    """diffusers' `VideoProcessor(vae_scale_factor).preprocess(image, height=height, width=width)[0]` for an RGB
    PIL image: float32 (3, H, W) in [-1, 1].

    diffusers floors width and height to multiples of `vae_scale_factor` (1 keeps them), then resizes with PIL
    (a copy when already that size, as `Image.resize` does), divides by 255 and maps to 2x - 1 in float32.
    """
    if image.mode != "RGB":
        raise ValueError(f"vae_pixels needs an RGB image, got mode {image.mode}; use load_image first")
    if resample not in _VAE_RESAMPLE:
        raise ValueError(f"unknown resample {resample!r}; one of {sorted(_VAE_RESAMPLE)}")
    width, height = width - width % vae_scale_factor, height - height % vae_scale_factor
    resized = image.resize((width, height), resample=_VAE_RESAMPLE[resample])
    x = np.asarray(resized).astype(np.float32) / 255.0
    return np.ascontiguousarray((2.0 * x - 1.0).transpose(2, 0, 1))


def letterbox_pixels(image: Image.Image, width: int, height: int) -> np.ndarray:
    """diffusers' `WanAnimateImageProcessor(resample="bilinear", fill_color=0).preprocess(image, height, width,
    resize_mode="fill")[0]` for an RGB PIL image (Wan-Animate's reference image): resized with Pillow's bilinear
    filter to fit width x height keeping its aspect, centred on black; float32 (3, H, W) in [-1, 1]."""
    if image.mode != "RGB":
        raise ValueError(f"letterbox_pixels needs an RGB image, got mode {image.mode}; use load_image first")
    wide = width / height < image.width / image.height
    fit_w = width if wide else image.width * height // image.height
    fit_h = height if not wide else image.height * width // image.width
    canvas = Image.new("RGB", (width, height), color=0)
    canvas.paste(image.resize((fit_w, fit_h), resample=Image.Resampling.BILINEAR),
                 box=(width // 2 - fit_w // 2, height // 2 - fit_h // 2))
    x = np.asarray(canvas).astype(np.float32) / 255.0
    return np.ascontiguousarray((2.0 * x - 1.0).transpose(2, 0, 1))


def _size_dict(value: Any, key: str, square: bool) -> dict[str, int]:
    """transformers' `get_size_dict`, for the forms CLIP configs use: an int is a square (crop_size) or the
    shortest edge (size, as CLIP has default_to_square=False); a pair is (height, width)."""
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple, dict)):
        raise UserError(f"image processor config: {key} must be an int, [height, width] or a dict, got {value!r}")
    if isinstance(value, int):
        value = {"height": value, "width": value} if square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise UserError(f"image processor config: {key} must be [height, width], got {value!r}")
        value = {"height": value[0], "width": value[1]}
    allowed = ({"height", "width"},) if square else ({"height", "width"}, {"shortest_edge"})
    if set(value) not in allowed or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                            for v in value.values()):
        raise UserError(f"image processor config: {key} must have positive int keys "
                        f"{' or '.join(str(sorted(a)) for a in allowed)}, got {value!r}")
    return {k: int(v) for k, v in value.items()}


def clip_config(config: dict) -> dict:
    """A `preprocessor_config.json`-style dict as the canonical JSON-safe dict `clip_pixels` uses.

    Missing or null keys take CLIPImageProcessorPil's defaults, unknown keys (image_processor_type, ...) are
    dropped; idempotent, so a canonical dict stored in a manifest can be passed back in.
    """
    if not isinstance(config, dict):
        raise UserError(f"image processor config must be a JSON object, got {type(config).__name__}")
    c = {k: (config[k] if config.get(k) is not None else v) for k, v in _CLIP_DEFAULTS.items()}
    out: dict[str, Any] = {k: bool(c[k]) for k in
                           ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb")}
    out["size"] = _size_dict(c["size"], "size", square=False)
    out["crop_size"] = _size_dict(c["crop_size"], "crop_size", square=True)
    resample = c["resample"]
    if isinstance(resample, bool) or not isinstance(resample, int) or resample not in {r.value for r in
                                                                                       Image.Resampling}:
        raise UserError(f"image processor config: resample must be a PIL resampling int (0-5), got {resample!r}")
    out["resample"] = int(resample)
    out["rescale_factor"] = float(c["rescale_factor"])
    for key in ("image_mean", "image_std"):
        v = c[key]
        v = [v] * 3 if isinstance(v, (int, float)) else list(v)
        if len(v) != 3:
            raise UserError(f"image processor config: {key} must have 3 values (RGB), got {c[key]!r}")
        out[key] = [float(x) for x in v]
    return out


def _center_crop(x: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """transformers' `center_crop` on (C, H, W): offsets floor((size - crop) / 2); zero-pads an image smaller
    than the crop, centred with ceil((crop - size) / 2) before it."""
    h, w = x.shape[1:]
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0:
        return x[:, top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    pad_top, pad_left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded = np.zeros((x.shape[0], new_h, new_w), dtype=x.dtype)
    padded[:, pad_top:pad_top + h, pad_left:pad_left + w] = x
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


def clip_pixels(images: list[Image.Image], config: dict) -> np.ndarray:
    """transformers' CLIP image processor `pixel_values` for `config` (raw or from `clip_config`):
    float32 (N, 3, crop_h, crop_w), or (N, 3, H, W) without center crop."""
    cfg = clip_config(config)
    out = []
    for image in images:
        if cfg["do_convert_rgb"]:
            image = _to_rgb(image, "image")
        elif image.mode != "RGB":
            raise ValueError(f"clip_pixels needs RGB images when do_convert_rgb is off, got mode {image.mode}")
        if cfg["do_resize"]:
            size = cfg["size"]
            if "shortest_edge" in size:
                # get_resize_output_image_size(default_to_square=False): short side -> n, long side truncated
                w, h = image.size
                short, long = (w, h) if w <= h else (h, w)
                new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
                new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
            else:
                new_w, new_h = size["width"], size["height"]
            image = image.resize((new_w, new_h), resample=cfg["resample"])
        x = np.asarray(image).transpose(2, 0, 1)
        if cfg["do_center_crop"]:
            x = _center_crop(x, cfg["crop_size"]["height"], cfg["crop_size"]["width"])
        # rescale in float64 then down to float32, normalize in float32, as transformers' numpy transforms do
        x = (x.astype(np.float64) * cfg["rescale_factor"]).astype(np.float32) if cfg["do_rescale"] \
            else x.astype(np.float32)
        if cfg["do_normalize"]:
            mean = np.array(cfg["image_mean"], dtype=np.float32)[:, None, None]
            std = np.array(cfg["image_std"], dtype=np.float32)[:, None, None]
            x = (x - mean) / std
        out.append(x)
    return np.stack(out).astype(np.float32, copy=False)
