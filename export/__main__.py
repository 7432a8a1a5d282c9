"""`python -m export`: build a bundle from a diffusers-format Wan checkpoint.

    python -m export --model tiny --resolution 64x64 --frames 9 --out artifacts/tiny
    python -m export --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --resolution 480p --out artifacts/wan-1.3b-480p
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from runtime import targets
from runtime.errors import UserError

from . import tiny
from .attention import AttentionConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help=f"diffusers-format directory, hub id, or embedded model ({', '.join(tiny.VARIANTS)})")
    p.add_argument("--revision", default=None, help="hub revision (hub ids only)")
    p.add_argument("--resolution", required=True, help="480p, 720p or WIDTHxHEIGHT (multiples of 16)")
    p.add_argument("--frames", type=int, default=81, help="video frames, 4k+1 (default 81)")
    p.add_argument("--batch", type=int, default=1, help="videos per call (default 1)")
    p.add_argument("--target", default="cpu", help=f"target preset ({', '.join(targets.PRESETS)})")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="text encoder and DiT dtype (the VAE always runs in fp32)")
    p.add_argument("--max-sequence-length", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--attention-block-q", type=int, default=AttentionConfig.block_q)
    p.add_argument("--attention-block-kv", type=int, default=AttentionConfig.block_kv)
    p.add_argument("--out", required=True, type=Path, help="bundle directory to create (e.g. artifacts/NAME)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def _quiet_build_libraries() -> None:
    """Silence the build stack's progress bars and known-harmless warnings (int64 -> int32 under torchax)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"Explicitly requested dtype int64")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|diffusers)\.")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Exporting needs no accelerator, whatever the target: keep JAX on the host CPU.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _quiet_build_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("export").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        from .build import Settings, build_bundle, check_frames, parse_resolution

        width, height = parse_resolution(args.resolution)
        frames = check_frames(args.frames)
        if args.batch < 1:
            raise UserError(f"--batch {args.batch} must be >= 1")
        if args.max_sequence_length < 1:
            raise UserError(f"--max-sequence-length {args.max_sequence_length} must be >= 1")
        target = targets.get(args.target)
        if args.out.exists() and not args.force:
            raise UserError(f"{args.out} already exists: choose another --out or pass --force to replace it")
        settings = Settings(width=width, height=height, frames=frames, batch=args.batch,
                            max_sequence_length=args.max_sequence_length, dtype=args.dtype, target=target,
                            attention=AttentionConfig(block_q=args.attention_block_q,
                                                      block_kv=args.attention_block_kv))
        from .source import load

        t0 = time.perf_counter()
        src = load(args.model, args.dtype, args.revision)
        manifest = build_bundle(src, settings, args.out, force=args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; no bundle was written", file=sys.stderr)
        return 130
    logging.getLogger("export").info("wrote %s (bundle %s) in %.1f s", args.out, manifest.bundle_id,
                                     time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
