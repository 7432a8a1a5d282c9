r"""`python -m export`: build a bundle from a diffusers-format Wan checkpoint.

    python -m export --model tiny --resolution 64x64 --frames 9 --out artifacts/tiny
    python -m export --model tiny --resolution 64x32,32x64 --frames 5,9 --out artifacts/tiny-4   # 4 shapes
    python -m export --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --resolution 480p --out artifacts/wan-1.3b-480p
    python -m export --model wan2.1-t2v-14b --no-weights --resolution 720p --target tpu-v6e-8 --out artifacts/14b
    python -m export attach artifacts/14b --weights Wan-AI/Wan2.1-T2V-14B-Diffusers
    python -m export --model tiny --resolution 64x64 --frames 9 --quantize int8 --out artifacts/tiny-int8
    python -m export attach artifacts/14b-int8 --weights Wan-AI/Wan2.1-T2V-14B-Diffusers \
        --dit-weights wan2.1_t2v_14b_int8_lightx2v.safetensors     # a pre-quantized DiT (lightx2v's layout)
    python -m export attach artifacts/ti2v --weights Wan-AI/Wan2.2-TI2V-5B-Diffusers \
        --dit-weights outputs/checkpoint                            # a TorchTitan run's DCP folder (its last step)
    python -m export --model wan2.1-t2v-14b-Q4_K_M.gguf --weights Wan-AI/Wan2.1-T2V-14B-Diffusers --resolution 480p \
        --out artifacts/14b-q4k                                     # a GGUF DiT, the rest from the checkpoint
    python -m export --model Wan-AI/Wan2.2-I2V-A14B-Diffusers --resolution 480p --target tpu-v6e-8 --out artifacts/i2v
    python -m export savedmodel artifacts/tiny --out artifacts/tiny-savedmodel     # TF Serving (extra: savedmodel)
    python -m export lora my_lora.safetensors --bundle artifacts/tiny --out artifacts/my_lora.safetensors
    python -m export --model Wan-AI/Wan2.1-T2V-14B-Diffusers --resolution 480p --out artifacts/14b-4step \
        --merge-lora lightx2v_T2V_14B_cfg_step_distill_v2_lora_rank64_bf16.safetensors \
        --defaults steps=4,guidance=1,sampler=euler,flow_shift=5      # a 4-step, CFG-free bundle
    python -m export --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --resolution 480p --out artifacts/1.3b-lightvae \
        --vae lightvaew2_1.safetensors                                 # lightx2v's LightVAE (original Wan layout)

The model kind (Wan 2.1/2.2, T2V, TI2V, I2V, FLF2V, one or two experts) is detected from the checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from runtime import targets
from runtime.cli import compile_for_fit, exit_code
from runtime.errors import UserError

from . import commands, flags, hub, tiny
from .architectures import ARCHITECTURES
from .attention import AttentionConfig
from .dtypes import DTYPES, choose_dtype
from .flash_tpu import FlashBlocks


def parser() -> argparse.ArgumentParser:
    """The build's parser (`python -m export --model ...`); the other commands' are export/commands.py's."""
    p = argparse.ArgumentParser(prog="python -m export", description=__doc__, epilog=commands.epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help=f"diffusers-format directory, hub id, architecture ({', '.join(ARCHITECTURES)}; "
                        f"with --no-weights), embedded model ({', '.join(tiny.VARIANTS)}; default: tiny), or a DiT's "
                        ".gguf file with --weights CHECKPOINT for the rest")
    p.add_argument("--no-weights", action="store_true",
                   help="build the programs from the model's config alone; attach weights later "
                        "(python -m export attach BUNDLE --weights SOURCE)")
    p.add_argument("--weights", metavar="SOURCE",
                   help="with --model FILE.gguf: the checkpoint (directory or hub id) of all but the DiT")
    flags.add_quantize(p)
    flags.add_weight_sources(p, " (with --model CHECKPOINT: a full export)")
    p.add_argument("--resolution", help="480p, 720p (the model family's native size, e.g. 1280x704 for TI2V-5B) or "
                                        "WIDTHxHEIGHT (multiples of the VAE's spatial scale x patch: 16, TI2V 32); "
                                        "a comma-separated list for several (e.g. 1280x720,720x1280)")
    p.add_argument("--frames", default=None, help="video frames, 4k+1 (default 81; Helios: 33, one chunk); a "
                                                   "comma-separated list for several. The bundle makes every "
                                                   "resolution x frames pair (its shapes; the first of each list is "
                                                   "the default) from one copy of the weights")
    p.add_argument("--reference-images", default=None, metavar="N,N,...",
                   help="VACE models: the counts of reference images the bundle serves, each a set of DiT programs "
                        "(a reference image is one more latent frame), the first the default (default 0,1)")
    p.add_argument("--video-to-video", action="store_true",
                   help="a text-to-video model (t2v, t2v-moe): also export the VAE encoder, so runs can start from a "
                        "source video (strength); a WanVideoToVideoPipeline checkpoint does this without the flag")
    p.add_argument("--batch", type=int, default=1, help="videos per call (default 1)")
    p.add_argument("--target", default="cpu", help=f"target preset ({', '.join(targets.PRESETS)}; default: cpu)")
    p.add_argument("--mesh", default=None, help="override the preset's mesh, e.g. dp=2,sp=1,tp=4")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="text encoder and DiT dtype (default: bf16; the VAE always runs in fp32); auto: for a cpu "
                        "target, bf16 where this machine's CPU has native bf16 (AMX or AVX512-BF16), else fp32 "
                        "(faster there); bf16 for other targets")
    p.add_argument("--max-sequence-length", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--attention-block-q", type=int, default=AttentionConfig.block_q,
                   help="plain-JAX attention (every target but TPU's DiT): queries per block of the online-softmax "
                        f"loop used for long sequences (default: {AttentionConfig.block_q})")
    p.add_argument("--attention-block-kv", type=int, default=AttentionConfig.block_kv,
                   help="plain-JAX attention: keys/values per block of that loop "
                        f"(default: {AttentionConfig.block_kv})")
    p.add_argument("--flash-block-q", type=int, default=FlashBlocks.block_q,
                   help=f"TPU kernel query block (default: {FlashBlocks.block_q})")
    p.add_argument("--flash-block-kv", type=int, default=FlashBlocks.block_kv,
                   help=f"TPU kernel key/value block (default: {FlashBlocks.block_kv})")
    p.add_argument("--flash-block-kv-compute", type=int, default=FlashBlocks.block_kv_compute,
                   help=f"TPU kernel inner key/value block (default: {FlashBlocks.block_kv_compute})")
    p.add_argument("--k-smoothing", action="store_true", help="TPU kernel: subtract K's mean (softmax-invariant)")
    p.add_argument("--fit", action="store_true",
                   help="TPU targets: compile every program for the target's slice with XLA's TPU compiler (libtpu, "
                        "no TPU needed) and write the bundle only if its per-device peak fits the chips' HBM "
                        "(`python -m runtime fit`); exit 1 and nothing written if it does not")
    p.add_argument("--hbm", type=float, default=None, metavar="GIB",
                   help="with --fit: HBM per chip to fit in (default: the chip's: v4 32, v5e 16, v5p 95, v6e 32)")
    p.add_argument("--precompile", action="store_true",
                   help="also compile every program for the target and write the executables into the bundle "
                        "(python -m export precompile BUNDLE): a matching host loads them instead of compiling")
    p.add_argument("--out", type=Path, help="bundle directory to create (e.g. artifacts/NAME)")
    flags.add_force_quiet(p, "--out")
    return p


def _quiet_build_libraries() -> None:
    """Silence the build stack's progress bars and known-harmless warnings (int64 -> int32 under torchax)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"Explicitly requested dtype int64")
    # SkyReels-V2's DiT builds its timestep sinusoid in float64 (torch.arange(..., dtype=float64)); JAX without x64
    # computes it in float32, as the runtime's programs always have (test_kinds checks the frames against diffusers).
    warnings.filterwarnings("ignore", message=r"Explicitly requested dtype float64 requested in arange")
    # torchax's index_put in bf16 models (RoPE) scatters fp32 values into bf16, as torch does.
    warnings.filterwarnings("ignore", message=r"scatter inputs have incompatible types", category=FutureWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|diffusers)\.")
    # diffusers 0.42 passes huggingface_hub 1.x+ an argument it has deprecated, on every hub read
    warnings.filterwarnings("ignore", message=r"The `local_dir_use_symlinks` argument is deprecated")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")  # its retries' warnings; a failed read says why (export/hub.py)
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def main(argv: list[str] | None = None) -> int:
    """`python -m export [COMMAND] ...`: the build without a command, else the command's (export/commands.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in commands.COMMANDS:
        _, make_parser, run = commands.COMMANDS[argv[0]]
        args = make_parser().parse_args(argv[1:])
    else:
        if (old := commands.old_spelling(argv)) is not None:
            print(f"error: {old}", file=sys.stderr)
            return 2
        args, run = parser().parse_args(argv), _build
    # Exporting needs no accelerator, whatever the target: keep JAX on the host CPU (precompiling a cuda bundle
    # needs its GPUs: export/precompile.py).
    if not (argv and argv[0] == "precompile"):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _quiet_build_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("export").setLevel(logging.WARNING if args.quiet else logging.INFO)

    def call() -> int:
        flags.check_needs(args)
        return run(args)

    return exit_code("python -m export", call, "; no bundle was written")  # runtime/cli.py: both CLIs' epilogue


def _build(args: argparse.Namespace) -> int:
    """The build: `python -m export --model ... --resolution ... --out ...`."""
    model, dit_weights = _model_and_dit_weights(args)
    from .build import build_bundle
    from .options import Settings, parse_defaults, parse_frames, parse_reference_images, parse_shapes, size_multiple

    needed = [flag for flag, value in (("--resolution", args.resolution), ("--out", args.out)) if value is None]
    if needed:
        raise UserError(f"{' and '.join(needed)} {'is' if len(needed) == 1 else 'are'} required to export (or add "
                        "weights to a bundle: python -m export attach BUNDLE --weights SOURCE)")
    if args.frames is not None:
        parse_frames(args.frames)  # a bad count fails before the model is read
    tiny = flags.tiny_decoder(args)  # as does a tiny decoder file that is not one
    run_defaults = parse_defaults(args.defaults)
    merges = flags.merges(args)
    if merges and args.no_weights:
        raise UserError("--merge-lora needs weights to merge into: drop --no-weights, or merge when attaching "
                        "(python -m export attach BUNDLE --weights SOURCE --merge-lora FILE)")
    if args.batch < 1:
        raise UserError(f"--batch {args.batch} must be >= 1")
    if args.max_sequence_length < 1:
        raise UserError(f"--max-sequence-length {args.max_sequence_length} must be >= 1")
    target = targets.resolve(args.target, args.mesh)
    check = _fit_check(args, target)  # a target that is not a TPU slice, or no libtpu: before any work
    if args.precompile and target.platform == "cuda":
        raise UserError(f"--precompile compiles a cuda bundle only where its GPUs are: export without it, then run "
                        f"`python -m export precompile {args.out}` on a machine with {target.num_devices} GPU(s)")
    if args.precompile and target.platform == "tpu":
        from runtime import fit

        fit.check_libtpu()  # the compile-only devices: before any work
    for name in ("flash_block_q", "flash_block_kv", "flash_block_kv_compute", "attention_block_q",
                 "attention_block_kv"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.out.exists() and not args.force:
        raise UserError(f"{args.out} already exists: choose another --out or pass --force to replace it")
    dtype = choose_dtype(args.dtype, target.platform)
    if dtype != args.dtype:
        logging.getLogger("export").info("--dtype %s: %s for this %s target", args.dtype, dtype, target.platform)
    from .source import load, with_vae_file

    t0 = time.perf_counter()
    with hub.errors_explained(model, "--model", args.revision):  # a hub id: configs now, weights in the build
        src = load(model, dtype, args.revision, weights=not args.no_weights)  # configs only, so far
        if args.vae is not None:
            src = with_vae_file(src, args.vae)
        shapes = parse_shapes(args.resolution, args.frames or str(src.model.frames), size_multiple(src))
        references = parse_reference_images(args.reference_images, src.model)
        if args.video_to_video:
            if src.model.conditioning != "none" or src.model.name == "ti2v":
                raise UserError(f"--video-to-video is for text-to-video models (t2v, t2v-moe); {model} is "
                                f"{src.model.title}")
            src.video_to_video = True
        settings = Settings(shapes=shapes, batch=args.batch,
                            max_sequence_length=args.max_sequence_length, dtype=dtype, target=target,
                            attention=AttentionConfig(
                                block_q=args.attention_block_q, block_kv=args.attention_block_kv,
                                flash=_flash_blocks(args),
                                k_smoothing=args.k_smoothing),
                            quantize=args.quantize, defaults=run_defaults, loras=tuple(merges),
                            reference_images=references, tiny_decoder=tiny)
        # Everything alive now (torch, diffusers, transformers, jax and the model's config) lives until the
        # process ends: frozen, the collections between components (build.py) and the tracer's own scan only
        # what the export allocates (a second a bundle, of a 14B one's ten of tracing).
        gc.freeze()
        if dit_weights:
            manifest = _export_with_dit_weights(src, settings, args.out, args.force, dit_weights, check)
        else:
            manifest = build_bundle(src, settings, args.out, force=args.force, check=check)
    if args.precompile:
        from .precompile import precompile

        manifest = precompile(args.out)
    logging.getLogger("export").info("wrote %s (bundle %s%s) in %.1f s", args.out, manifest.bundle_id,
                                     "" if manifest.has_weights else ", no weights", time.perf_counter() - t0)
    return 0


def _model_and_dit_weights(args: argparse.Namespace) -> tuple[str, list[Path]]:
    """The checkpoint to export and the DiT files replacing its DiT (--dit-weights). `--model FILE.gguf --weights
    CHECKPOINT` is `--model CHECKPOINT --dit-weights FILE.gguf [--dit-weights ...]`: a GGUF file holds the DiT only,
    so the text encoder, VAE, tokenizer and configs come from the checkpoint."""
    model, dit_weights = str(args.model), list(args.dit_weights or [])
    if model.endswith(".gguf"):
        if args.weights is None:
            raise UserError(f"--model {model} is a GGUF file, which holds the DiT only: give the checkpoint of "
                            "everything else (text encoder, VAE, tokenizer) as --weights SOURCE")
        model, dit_weights = args.weights, [Path(model), *dit_weights]
    elif args.weights is not None:
        raise UserError("--weights goes with --model FILE.gguf (the checkpoint of everything but the DiT); to add a "
                        "checkpoint's weights to a bundle: python -m export attach BUNDLE --weights SOURCE")
    if dit_weights and args.no_weights:
        raise UserError("--dit-weights needs the checkpoint's other weights: drop --no-weights (or attach later: "
                        "python -m export attach BUNDLE --weights SOURCE --dit-weights FILE)")
    return model, dit_weights


def _export_with_dit_weights(src: Any, settings: Any, out: Path, force: bool, dit_weights: list[Path],
                             check: Any) -> Any:
    """An export whose DiT comes from --dit-weights: the programs built without weights, then every weight attached
    as `python -m export attach` does (one code path for both: the same checks, casts and quantization), all in a hidden
    sibling of --out renamed into place only when complete, so a refusal anywhere leaves nothing written."""
    import dataclasses
    import shutil

    from .attach import attach_weights
    from .build import build_bundle
    from .bundle_files import replace_dir

    staging = out.parent / f".{out.name}.dit-weights-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        programs_only = dataclasses.replace(settings, loras=())  # LoRAs are merged by the attach, into the file's DiT
        build_bundle(dataclasses.replace(src, weights=False), programs_only, staging, check=check)
        manifest = attach_weights(staging, src, dit_weights=dit_weights, merges=list(settings.loras),
                                  tiny_decoder=settings.tiny_decoder)
        if out.exists() and not force:
            raise UserError(f"{out} already exists: choose another --out or pass --force to replace it")
        replace_dir(staging, out)
        return manifest
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _fit_check(args: argparse.Namespace, target: targets.Target) -> Any:
    """With --fit: build_bundle's check, compiling the finished bundle for the target's slice (runtime/fit.py) and
    refusing it where it does not fit; None without."""
    if not args.fit:
        return None
    from runtime import fit

    if target.platform != "tpu":
        raise UserError(f"--fit compiles for a TPU slice; target {target.name} is {target.platform}: use --target "
                        "tpu-... (e.g. tpu-v6e-8)")
    targets.chip(target), targets.topology(target)  # a slice libtpu can make, or one line now
    fit.check_libtpu()
    if args.hbm is not None and not 0 < args.hbm < float("inf"):
        raise UserError(f"--hbm {args.hbm} must be a number of GiB > 0")
    log = logging.getLogger("export")

    def check(directory: Path, manifest: Any) -> None:
        log.info("compiling every program for %s (%s) with XLA's TPU compiler", target.name, targets.topology(target))
        report = compile_for_fit(directory, args.hbm, log, manifest=manifest, verify=False)  # as `runtime fit`
        for line in fit.format_text(report).splitlines():
            log.info("%s", line)
        fit.check(report)
        fit.record(report, manifest.bundle_id, directory)

    return check


def _flash_blocks(args: argparse.Namespace) -> FlashBlocks:
    try:
        return FlashBlocks(args.flash_block_q, args.flash_block_kv, args.flash_block_kv_compute)
    except ValueError as e:
        raise UserError(f"bad --flash-block-* sizes: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
