"""The export's settings, parsed from its flags and checked before any model is read: the shapes (--resolution x
--frames), VACE's reference image counts, and the bundle's run defaults (--defaults) over the checkpoint's."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import scheduler as sched
from runtime import settings as run_settings
from runtime.errors import UserError
from runtime.kinds import Kind
from runtime.manifest import Defaults, Target

from . import lora
from .attention import AttentionConfig
from .source import Source

RESOLUTIONS = {"480p": (832, 480), "720p": (1280, 720)}


@dataclass(frozen=True)
class Settings:
    shapes: tuple[tuple[int, int, int], ...]  # (width, height, frames) of each shape, the default first
    batch: int
    max_sequence_length: int
    dtype: str  # "bf16" | "fp32"
    target: Target
    attention: AttentionConfig = AttentionConfig()
    quantize: str | None = None  # export/quantize.py MODES
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # --defaults: run defaults over the checkpoint's
    loras: tuple[lora.MergeSpec, ...] = ()  # --merge-lora / --merge-lora-2: merged into the DiT's weights
    reference_images: tuple[int, ...] = (0,)  # VACE: the counts of reference images the DiT programs serve
    tiny_decoder: TinyDecoderFile | None = None  # --tiny-decoder: a second decoder beside the VAE's


@dataclass(frozen=True)
class TinyDecoderFile:
    path: Path
    latents: str  # export/tiny_decoder.py LATENTS
    decoder: Any = None  # the file read (tiny_decoder.read), or None: read when needed


def size_multiple(src: Source) -> int:
    """Pixel sizes must divide by the VAE's spatial scale times the DiT's patch (16 for Wan 2.1, 32 for TI2V)."""
    s_scale = int(src.vae_config.get("scale_factor_spatial") or 8)
    return s_scale * int(max(src.transformer_config["patch_size"][1:]))


def parse_resolution(text: str, multiple: int = 16) -> tuple[int, int]:
    """'480p', '720p' (the family's native size: 1280x720 rounded down to `multiple`, as diffusers rounds,
    e.g. 1280x704 for TI2V-5B) or 'WxH' -> (width, height), both multiples of `multiple`."""
    if text in RESOLUTIONS:
        w, h = RESOLUTIONS[text]
        return w // multiple * multiple, h // multiple * multiple
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m:
        raise UserError(f"resolution {text!r} is not 480p, 720p or WIDTHxHEIGHT (e.g. 832x480)")
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0 or w % multiple or h % multiple:
        near = f"{max(multiple, round(w / multiple) * multiple)}x{max(multiple, round(h / multiple) * multiple)}"
        raise UserError(f"resolution {w}x{h} is not a multiple of {multiple} in both width and height (the VAE's "
                        f"spatial scale times the DiT's patch size for this model): try {near}")
    return w, h


def check_frames(frames: int) -> int:
    if frames < 1 or (frames - 1) % 4:
        lo = max(1, (frames - 1) // 4 * 4 + 1)
        raise UserError(f"--frames {frames} is not of the form 4k+1 (try {lo} or {lo + 4})")
    return frames


def parse_frames(text: str) -> list[int]:
    """'81' or '49,81' -> [81] or [49, 81], each of the form 4k+1."""
    out = []
    for part in str(text).split(","):
        if not part.strip().isdigit():
            raise UserError(f"--frames {text!r} is not a frame count or a comma-separated list of them (e.g. 81 or "
                            "49,81)")
        out.append(check_frames(int(part)))
    return out


def parse_reference_images(text: str | None, kind: Kind) -> tuple[int, ...]:
    """--reference-images "0,1" -> (0, 1): the counts a VACE bundle serves (default 0 and 1), the first the default;
    refused for other kinds."""
    if not kind.reference_images:
        if text is not None:
            raise UserError(f"--reference-images is for VACE models; this model is {kind.title}")
        return (0,)
    counts = []
    for part in (text or "0,1").split(","):
        if not part.strip().isdigit():
            raise UserError(f"--reference-images {text!r} is not a comma-separated list of counts (e.g. 0,1,2)")
        counts.append(int(part))
    if len(set(counts)) != len(counts):
        raise UserError(f"--reference-images {text!r} lists a count twice: list each once")
    return tuple(counts)


def parse_shapes(resolutions: str, frames: str, multiple: int = 16) -> tuple[tuple[int, int, int], ...]:
    """--resolution R1,R2,... x --frames F1,F2,... -> every (width, height, frames), in the order given (the first
    resolution with the first frame count is the default shape); a resolution or count given twice is refused."""
    sizes = [parse_resolution(r, multiple) for r in resolutions.split(",")]
    counts = parse_frames(frames)
    for what, values, show in (("--resolution", sizes, lambda v: f"{v[0]}x{v[1]}"), ("--frames", counts, str)):
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        if twice:
            raise UserError(f"{what} lists {show(twice[0])} twice (after resolving 480p/720p): list each once")
    return tuple((w, h, f) for w, h in sizes for f in counts)


DEFAULT_KEYS = ("steps", "guidance", "guidance_2", "flow_shift", "sampler", "sigmas", "fps", "timestep_scale")


def parse_defaults(text: str | None) -> dict[str, Any]:
    """--defaults "steps=4,guidance=1,sampler=euler,flow_shift=5,sigmas=1,0.75,0.5,0.25" -> {key: value}. A bare
    number after sigmas= is one more sigma. Values are checked against the model in `defaults_for`."""
    out: dict[str, Any] = {}
    last = None
    for item in (text.split(",") if text else []):
        item = item.strip()
        key, sep, value = item.partition("=")
        if not sep and last == "sigmas":
            out["sigmas"].append(item)
            continue
        key = key.strip().replace("-", "_")
        if not sep or key not in DEFAULT_KEYS:
            raise UserError(f"--defaults {text!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(DEFAULT_KEYS)}")
        if key in out:
            raise UserError(f"--defaults {text!r} sets {key} twice")
        out[key] = [value.strip()] if key == "sigmas" else value.strip()
        last = key
    try:
        for key in ("steps", "fps"):
            if key in out:
                out[key] = int(out[key])
        for key in ("guidance", "guidance_2", "flow_shift", "timestep_scale"):
            if key in out:
                out[key] = float(out[key])
        if "sigmas" in out:
            out["sigmas"] = [float(v) for v in out["sigmas"]]
    except ValueError as e:
        raise UserError(f"--defaults {text!r}: {e}") from None
    return out


def defaults_for(kind: Kind, config: sched.UniPCConfig, base: Defaults, given: dict[str, Any]) -> Defaults:
    """The bundle's run defaults: the checkpoint's (`base`) with what --defaults sets, checked as a run's settings
    are (runtime/settings.py), so a bundle never defaults to settings it would refuse."""
    d = dataclasses.replace(base, **{k: (tuple(v) if k == "sigmas" else v) for k, v in given.items()})
    if "sigmas" in given and "steps" not in given:
        d = dataclasses.replace(d, steps=len(d.sigmas))
    if not 1 <= d.fps <= 240:
        raise UserError(f"--defaults fps={d.fps} must be in 1..240")
    if not 0 < d.timestep_scale < float("inf"):
        raise UserError(f"--defaults timestep_scale={d.timestep_scale:g} must be a number > 0 (1000 for released Wan "
                        "weights, 1 for a checkpoint trained on t = sigma, as TorchTitan's Wan trainer does)")
    try:
        run_settings.resolve(dataclasses.replace(d, guidance_2=None), kind, config, guidance_2=d.guidance_2,
                             sigmas=d.sigmas, steps=d.steps)
    except UserError as e:
        raise UserError(f"--defaults: {e}") from None
    return d
