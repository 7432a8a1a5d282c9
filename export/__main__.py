r"""`python -m export`: build a bundle from a diffusers-format Wan checkpoint.

    python -m export --model tiny --resolution 64x64 --frames 9 --out artifacts/tiny
    python -m export --model tiny --resolution 64x32,32x64 --frames 5,9 --out artifacts/tiny-4   # 4 shapes
    python -m export --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --resolution 480p --out artifacts/wan-1.3b-480p
    python -m export --model wan2.1-t2v-14b --no-weights --resolution 720p --target tpu-v6e-8 --out artifacts/14b
    python -m export --attach-weights artifacts/14b --weights Wan-AI/Wan2.1-T2V-14B-Diffusers
    python -m export --model tiny --resolution 64x64 --frames 9 --quantize int8 --out artifacts/tiny-int8
    python -m export --attach-weights artifacts/14b-int8 --weights Wan-AI/Wan2.1-T2V-14B-Diffusers \
        --dit-weights wan2.1_t2v_14b_int8_lightx2v.safetensors     # a pre-quantized DiT (lightx2v's layout)
    python -m export --attach-weights artifacts/ti2v --weights Wan-AI/Wan2.2-TI2V-5B-Diffusers \
        --dit-weights outputs/checkpoint                            # a TorchTitan run's DCP folder (its last step)
    python -m export --model wan2.1-t2v-14b-Q4_K_M.gguf --weights Wan-AI/Wan2.1-T2V-14B-Diffusers --resolution 480p \
        --out artifacts/14b-q4k                                     # a GGUF DiT, the rest from the checkpoint
    python -m export --model Wan-AI/Wan2.2-I2V-A14B-Diffusers --resolution 480p --target tpu-v6e-8 --out artifacts/i2v
    python -m export --savedmodel artifacts/tiny --out artifacts/tiny-savedmodel    # TF Serving (extra: savedmodel)
    python -m export --lora my_lora.safetensors --bundle artifacts/tiny --out artifacts/my_lora.safetensors
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
from runtime.errors import UserError
from runtime.extras import missing
from runtime.fit import DoesNotFit

from . import hub, tiny
from .architectures import ARCHITECTURES
from .attention import AttentionConfig
from .flash_tpu import FlashBlocks
from .quantize import MODES


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help=f"diffusers-format directory, hub id, architecture ({', '.join(ARCHITECTURES)}; "
                        f"with --no-weights), embedded model ({', '.join(tiny.VARIANTS)}; default: tiny), or a DiT's "
                        ".gguf file with --weights CHECKPOINT for the rest")
    p.add_argument("--no-weights", action="store_true",
                   help="build the programs from the model's config alone; attach weights later")
    p.add_argument("--attach-weights", type=Path, metavar="BUNDLE",
                   help="instead of exporting: add the weights of --weights to this --no-weights bundle")
    p.add_argument("--weights", metavar="SOURCE",
                   help="checkpoint (directory or hub id) for --attach-weights, or for --model FILE.gguf (all but "
                        "the DiT)")
    p.add_argument("--quantize", choices=MODES, default=None,
                   help="store the DiT's and the encoders' linear layers in 8 bits with a scale per output channel "
                        "(int8 or fp8: weights only, dequantized next to the matmul; int8-dynamic: int8 weights and "
                        "int8 activations per token, int8 x int8 -> int32 dots). With --attach-weights it must be "
                        "the mode the bundle was exported with (the default)")
    p.add_argument("--dit-weights", action="append", type=Path, metavar="FILE",
                   help="the DiT's weights from this file instead of the checkpoint's (with --attach-weights, or "
                        "with --model CHECKPOINT for a full export), in the "
                        "original Wan layout (`blocks.N.self_attn.q.weight`, as lightx2v and ComfyUI ship full and "
                        "step-distilled DiTs; a .safetensors file or a directory of them), or a training run's "
                        "torch.distributed.checkpoint folder (TorchTitan's step-N/, or its parent: the highest step; "
                        "the model's keys only): bf16/fp32, cast to the bundle's dtype, or pre-quantized (int8 / "
                        "float8_e4m3fn with a per-row weight_scale) for a bundle of that --quantize mode, used as is; "
                        "or a .gguf file (city96's layout: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K), "
                        "dequantized to the bundle's dtype or requantized per row for --quantize; "
                        "give it once per expert, the high-noise one first")
    p.add_argument("--vae", type=Path, metavar="FILE",
                   help="replace the checkpoint's VAE (encoder and decoder) by a Wan 2.1 VAE in the original Wan "
                        "layout (`encoder.downsamples.N.residual.2.weight`, `decoder.upsamples.N...`; a .safetensors "
                        "file such as lightx2v's LightVAE lightvaew2_1 or Wan2.1_VAE), its widths read from its "
                        "tensors; its latent space (z_dim, scales) must be the model's, whose latents_mean/std it "
                        "keeps. For an export (also --no-weights) or --attach-weights")
    p.add_argument("--savedmodel", type=Path, metavar="BUNDLE",
                   help="instead of exporting: write this finished cpu/cuda bundle as a TensorFlow SavedModel "
                        "(TF Serving layout: OUT/1/saved_model.pb) to --out; needs the savedmodel extra, not torch")
    p.add_argument("--validate", action="store_true",
                   help="with --savedmodel: run every signature in TF and in JAX and compare (cpu bundles)")
    p.add_argument("--lora", type=Path, metavar="SOURCE",
                   help="instead of exporting: convert this LoRA (any format diffusers' Wan loader reads, "
                        ".safetensors) into an adapter for --bundle, written to --out")
    p.add_argument("--bundle", type=Path, help="with --lora: the bundle the adapter is for")
    p.add_argument("--lora-into", choices=("transformer", "transformer_2"), default=None,
                   help="with --lora: load the LoRA's `transformer` keys into this expert (diffusers' "
                        "load_into_transformer_2; e.g. a Wan 2.2 low-noise LoRA)")
    p.add_argument("--defaults", metavar="KEY=VALUE,...",
                   help="the bundle's run defaults, over the checkpoint's (steps 50, guidance 5, its scheduler's "
                        "sampler and flow shift): steps, guidance, guidance_2, flow_shift, sampler (unipc, euler, "
                        "dpm++), sigmas (the last key: sigmas=1,0.75,0.5,0.25), fps, timestep_scale (the DiT is fed "
                        "t = sigma x timestep_scale: 1000 as released Wan, 1 for a TorchTitan-trained checkpoint); "
                        "e.g. "
                        "steps=4,guidance=1,sampler=euler,flow_shift=5 for a step-distilled model")
    p.add_argument("--merge-lora", action="append", default=[], metavar="FILE[:SCALE]",
                   help="merge this LoRA (diffusers, PEFT, ComfyUI/lightx2v `diffusion_model.` or musubi keys; "
                        ".safetensors) into the DiT's weights at export, scale default 1 (repeatable); its "
                        "`transformer` keys go to the first (high-noise) expert")
    p.add_argument("--merge-lora-2", action="append", default=[], metavar="FILE[:SCALE]",
                   help="as --merge-lora, into the second (low-noise) expert `transformer_2` of a two-expert model "
                        "(e.g. Wan2.2-Lightning's low-noise LoRA)")
    p.add_argument("--tiny-decoder", type=Path, metavar="FILE",
                   help="also export a tiny decoder (a TAEHV-layout .safetensors: taew2_1, taew2_2, taew2_2_super, "
                        "lighttaew2_*) beside the VAE, for `--decoder tiny` runs and live previews")
    p.add_argument("--tiny-decoder-latents", choices=("normalized", "raw"), default=None,
                   help="what the tiny decoder takes: the DiT's normalised latents (taew) or raw VAE latents "
                        "(lighttae: z*std + mean first); default: raw when the file name holds 'lighttae'")
    p.add_argument("--revision", default=None, help="hub revision (hub ids only)")
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
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="text encoder and DiT dtype (default: bf16; the VAE always runs in fp32)")
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
    p.add_argument("--out", type=Path, help="bundle directory to create (e.g. artifacts/NAME)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (or weights already attached)")
    p.add_argument("-q", "--quiet", action="store_true", help="no info logs (errors still print)")
    return p


def _quiet_build_libraries() -> None:
    """Silence the build stack's progress bars and known-harmless warnings (int64 -> int32 under torchax)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"Explicitly requested dtype int64")
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
    args = parser().parse_args(argv)
    # Exporting needs no accelerator, whatever the target: keep JAX on the host CPU.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _quiet_build_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("export").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        if args.vae is not None and (args.savedmodel is not None or args.lora is not None):
            raise UserError("--vae goes with an export (--model ...) or --attach-weights BUNDLE --weights SOURCE")
        if args.attach_weights is not None:
            with hub.errors_explained(args.weights, "--weights", args.revision):
                return _attach(args)
        if args.savedmodel is not None:
            return _savedmodel(args)
        if args.lora is not None:
            return _lora(args)
        if args.bundle is not None or args.lora_into is not None:
            raise UserError("--bundle and --lora-into go with --lora SOURCE")
        if args.validate:
            raise UserError("--validate goes with --savedmodel BUNDLE")
        _gguf_model(args)  # --model FILE.gguf --weights CHECKPOINT: the GGUF is the first expert's --dit-weights
        if args.weights is not None:
            raise UserError("--weights goes with --attach-weights BUNDLE, or with --model FILE.gguf (the checkpoint "
                            "of everything but the DiT)")
        if args.dit_weights and args.no_weights:
            raise UserError("--dit-weights needs the checkpoint's other weights: drop --no-weights (or attach later: "
                            "--attach-weights BUNDLE --weights SOURCE --dit-weights FILE)")
        from .build import (
            Settings,
            build_bundle,
            parse_defaults,
            parse_frames,
            parse_reference_images,
            parse_shapes,
            size_multiple,
        )

        needed = [flag for flag, value in (("--resolution", args.resolution), ("--out", args.out)) if value is None]
        if needed:
            raise UserError(f"{' and '.join(needed)} {'is' if len(needed) == 1 else 'are'} required to export (or use "
                            "--attach-weights BUNDLE --weights SOURCE)")
        if args.frames is not None:
            parse_frames(args.frames)  # a bad count fails before the model is read
        tiny = _tiny_decoder(args)  # as does a tiny decoder file that is not one
        run_defaults = parse_defaults(args.defaults)
        merges = _merges(args)
        if merges and args.no_weights:
            raise UserError("--merge-lora needs weights to merge into: drop --no-weights, or merge when attaching "
                            "(--attach-weights BUNDLE --weights SOURCE --merge-lora FILE)")
        if args.batch < 1:
            raise UserError(f"--batch {args.batch} must be >= 1")
        if args.max_sequence_length < 1:
            raise UserError(f"--max-sequence-length {args.max_sequence_length} must be >= 1")
        target = targets.resolve(args.target, args.mesh)
        check = _fit_check(args, target)  # a target that is not a TPU slice, or no libtpu: before any work
        for name in ("flash_block_q", "flash_block_kv", "flash_block_kv_compute", "attention_block_q",
                     "attention_block_kv"):
            if getattr(args, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1")
        if args.out.exists() and not args.force:
            raise UserError(f"{args.out} already exists: choose another --out or pass --force to replace it")
        from .source import load, with_vae_file

        t0 = time.perf_counter()
        with hub.errors_explained(args.model, "--model", args.revision):  # a hub id: configs now, weights in the build
            src = load(args.model, args.dtype, args.revision, weights=not args.no_weights)  # configs only, so far
            if args.vae is not None:
                src = with_vae_file(src, args.vae)
            shapes = parse_shapes(args.resolution, args.frames or str(src.model.frames), size_multiple(src))
            references = parse_reference_images(args.reference_images, src.model)
            if args.video_to_video:
                if src.model.conditioning != "none" or src.model.name == "ti2v":
                    raise UserError(f"--video-to-video is for text-to-video models (t2v, t2v-moe); {args.model} is "
                                    f"{src.model.title}")
                src.video_to_video = True
            settings = Settings(shapes=shapes, batch=args.batch,
                                max_sequence_length=args.max_sequence_length, dtype=args.dtype, target=target,
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
            if args.dit_weights:
                manifest = _export_with_dit_weights(src, settings, args, check)
            else:
                manifest = build_bundle(src, settings, args.out, force=args.force, check=check)
    except ModuleNotFoundError as e:  # the export extra (torch, diffusers, ...) not installed: say so in one line
        error = missing(e, "python -m export")
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DoesNotFit as e:
        print(f"error: {e}; no bundle was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; no bundle was written", file=sys.stderr)
        return 130
    logging.getLogger("export").info("wrote %s (bundle %s%s) in %.1f s", args.out, manifest.bundle_id,
                                     "" if manifest.has_weights else ", no weights", time.perf_counter() - t0)
    return 0


def _gguf_model(args: argparse.Namespace) -> None:
    """`--model FILE.gguf --weights CHECKPOINT` is `--model CHECKPOINT --dit-weights FILE.gguf [--dit-weights ...]`:
    a GGUF file holds the DiT only, so the text encoder, VAE, tokenizer and configs come from the checkpoint."""
    if not str(args.model).endswith(".gguf"):
        return
    if args.weights is None:
        raise UserError(f"--model {args.model} is a GGUF file, which holds the DiT only: give the checkpoint of "
                        "everything else (text encoder, VAE, tokenizer) as --weights SOURCE")
    args.dit_weights = [Path(args.model), *(args.dit_weights or [])]
    args.model, args.weights = args.weights, None


def _export_with_dit_weights(src: Any, settings: Any, args: argparse.Namespace, check: Any) -> Any:
    """An export whose DiT comes from --dit-weights: the programs built without weights, then every weight attached
    as `--attach-weights` does (one code path for both: the same checks, casts and quantization), all in a hidden
    sibling of --out renamed into place only when complete, so a refusal anywhere leaves nothing written."""
    import dataclasses
    import shutil

    from .attach import attach_weights
    from .build import build_bundle, replace_dir

    staging = args.out.parent / f".{args.out.name}.dit-weights-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        programs_only = dataclasses.replace(settings, loras=())  # LoRAs are merged by the attach, into the file's DiT
        build_bundle(dataclasses.replace(src, weights=False), programs_only, staging, check=check)
        manifest = attach_weights(staging, src, dit_weights=args.dit_weights, merges=list(settings.loras),
                                  tiny_decoder=settings.tiny_decoder)
        if args.out.exists() and not args.force:
            raise UserError(f"{args.out} already exists: choose another --out or pass --force to replace it")
        replace_dir(staging, args.out)
        return manifest
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _fit_check(args: argparse.Namespace, target: targets.Target) -> Any:
    """With --fit: build_bundle's check, compiling the finished bundle for the target's slice (runtime/fit.py) and
    refusing it where it does not fit; None without."""
    if args.hbm is not None and not args.fit:
        raise UserError("--hbm goes with --fit")
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
        report = fit.fit(directory, args.hbm, manifest=manifest, verify=False,
                         on_compiled=lambda c: log.info("compiled %s in %.1f s", c.key, c.compile_s))
        for line in fit.format_text(report).splitlines():
            log.info("%s", line)
        fit.check(report)
        fit.record(report, manifest.bundle_id, directory)

    return check


def _merges(args: argparse.Namespace) -> list:
    """--merge-lora / --merge-lora-2 as (file, scale, expert) (export/lora.py); a missing file fails here."""
    from .lora import parse_merge

    return ([parse_merge(t, None) for t in args.merge_lora]
            + [parse_merge(t, "transformer_2") for t in args.merge_lora_2])


def _flash_blocks(args: argparse.Namespace) -> FlashBlocks:
    try:
        return FlashBlocks(args.flash_block_q, args.flash_block_kv, args.flash_block_kv_compute)
    except ValueError as e:
        raise UserError(f"bad --flash-block-* sizes: {e}") from None


def _savedmodel(args: argparse.Namespace) -> int:
    from .savedmodel import convert

    if args.out is None:
        raise UserError("--savedmodel BUNDLE needs --out DIR (the SavedModel base directory TF Serving loads)")
    t0 = time.perf_counter()
    info = convert(args.savedmodel, args.out, force=args.force, validate=args.validate)
    logging.getLogger("export").info("wrote %s (SavedModel of bundle %s, %d signatures) in %.1f s", args.out,
                                     info["bundle_id"], len(info["signatures"]), time.perf_counter() - t0)
    return 0


def _lora(args: argparse.Namespace) -> int:
    from .lora import convert

    if args.bundle is None or args.out is None:
        raise UserError("--lora SOURCE needs --bundle BUNDLE (the bundle it is for) and --out ADAPTER.safetensors")
    if not (args.bundle / "manifest.json").is_file():
        raise UserError(f"--bundle {args.bundle} is not a bundle (no manifest.json)")
    convert(args.lora, args.bundle, args.out, into=args.lora_into, force=args.force)
    return 0


def _tiny_decoder(args: argparse.Namespace) -> Any:
    """--tiny-decoder FILE [--tiny-decoder-latents normalized|raw], or None."""
    from .build import TinyDecoderFile
    from .tiny_decoder import default_latents, read

    if args.tiny_decoder is None:
        if args.tiny_decoder_latents is not None:
            raise UserError("--tiny-decoder-latents goes with --tiny-decoder FILE")
        return None
    return TinyDecoderFile(args.tiny_decoder, args.tiny_decoder_latents or default_latents(args.tiny_decoder),
                           read(args.tiny_decoder))


def _attach(args: argparse.Namespace) -> int:
    from runtime import manifest as mf

    from .attach import attach_weights
    from .source import load, with_vae_file

    if not args.weights:
        raise UserError("--attach-weights needs --weights SOURCE (a diffusers-format directory or hub id)")
    t0 = time.perf_counter()
    if Path(args.weights).is_file() and args.weights.endswith(".safetensors"):
        raise UserError(f"--weights {args.weights} is one file: give the whole diffusers-format checkpoint as "
                        "--weights (for the text encoder, VAE and tokenizer) and a pre-quantized DiT file as "
                        "--dit-weights")
    from .build import parse_defaults

    run_defaults, merges = parse_defaults(args.defaults), _merges(args)
    dtype = mf.read(args.attach_weights).dtype
    src = load(args.weights, dtype, args.revision)
    if args.vae is not None:
        src = with_vae_file(src, args.vae)
    manifest = attach_weights(args.attach_weights, src, force=args.force,
                              quantize=args.quantize, dit_weights=args.dit_weights or [], defaults=run_defaults,
                              merges=merges, tiny_decoder=_tiny_decoder(args))
    logging.getLogger("export").info("attached weights to %s (bundle %s) in %.1f s", args.attach_weights,
                                     manifest.bundle_id, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
