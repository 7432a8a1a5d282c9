"""What `python -m runtime`'s flags name, read and checked before a bundle is loaded: the MagCache, the LoRA
adapters, the videos and Wan-Animate's inputs, and the loops' own keywords of `generate` (runtime/loop_settings.py),
each as `generate`, `encode` and `denoise` take it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import loop_settings


def magcache_from_args(args: argparse.Namespace) -> object | None:
    """The runtime.MagCache the flags ask for, or None; a bad file or value is a UserError."""
    if args.magcache is None:
        return None
    from .magcache import MagCache, load_ratios

    return MagCache(load_ratios(args.magcache), threshold=args.magcache_threshold,
                    max_skip_steps=args.magcache_max_skip, retention_ratio=args.magcache_retention)


def loras_from_args(args: argparse.Namespace) -> list[tuple[Path, float]]:
    """--lora ADAPTER[:SCALE] flags as (file, scale); a bad spelling is a UserError."""
    from .lora import parse_spec

    return [parse_spec(text) for text in getattr(args, "lora", [])]


def loop_args(args: argparse.Namespace, kind: Any) -> dict[str, Any]:
    """The loops' own keywords of `generate`: the flags given (another kind's bundle refuses them in one line); for an
    any-length bundle (diffusion forcing, Helios) `--frames` is the video's length, and diffusion forcing tells its
    DiT `--fps` too; Wan-Animate 2 resamples its driving video to `--fps` from `--driving-video-fps` (default: the
    file's frame rate)."""
    out: dict[str, Any] = {}
    for loop in ("forcing", "helios", "chronoedit", "animate-2"):
        out.update(loop_settings.given(args, loop))
    if kind.animate2:  # the video's frame rate, which the driving video is resampled to (from the file's own)
        out.update(fps=getattr(args, "fps", None))
        if out.get("driving_video_fps") is None and out.get("driving_video") is not None:
            from .animate2_media import video_fps

            out["driving_video_fps"] = video_fps(out["driving_video"])
    if kind.forcing:
        out.update(num_frames=getattr(args, "frames", None), fps=getattr(args, "fps", None))
    if kind.helios:
        out.update(num_frames=getattr(args, "frames", None))
    return out


def animate_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Wan-Animate inputs the flags name, read and checked against each other (runtime/animate.py); {} if the
    flags name none."""
    names = ("pose_video", "face_video", "background_video", "mask_video")
    if all(getattr(args, n, None) is None for n in names) and getattr(args, "mode", None) is None:
        return {}
    from .animate import load_inputs

    mode = args.mode or "animate"
    videos = load_inputs(args.pose_video, args.face_video, mode, args.background_video, args.mask_video)
    return {"pose_video": videos.pose, "face_video": videos.face, "background_video": videos.background,
            "mask_video": videos.mask, "mode": mode, "prev_segment_frames": args.prev_segment_frames}


def video_args(args: argparse.Namespace) -> dict[str, Any]:
    """The video inputs the flags name, read (PIL frames), as generate/encode take them; {} if none."""
    from .images import load_image
    from .video_input import load_frames, load_mask

    out: dict[str, Any] = {}
    if getattr(args, "video", None) is not None:
        out["video"] = load_frames(args.video, "--video")
    if getattr(args, "mask", None) is not None:
        out["mask"] = load_mask(args.mask, "--mask")
    if getattr(args, "reference_image", None):
        out["reference_images"] = [load_image(p, f"--reference-image {p}") for p in args.reference_image]
    return out
