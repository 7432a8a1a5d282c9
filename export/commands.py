"""`python -m export attach | savedmodel | lora`: the jobs beside the build, each a command with its own parser.

    python -m export attach BUNDLE --weights SOURCE [--dit-weights FILE ...] [--quantize MODE] [--vae FILE] ...
    python -m export savedmodel BUNDLE --out DIR [--validate]
    python -m export lora FILE --bundle BUNDLE --out ADAPTER.safetensors [--lora-into transformer_2]
    python -m export precompile BUNDLE

Each takes only its own flags, so a flag of another job is refused by argparse, in one line, and no command checks
which of the others' flags came with it. The build itself (`python -m export --model ...`) is export/__main__.py's.
Before they were commands these jobs were flags of the build; OLD_SPELLINGS answers those in one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from runtime.errors import UserError

from . import flags, hub

# The flags that used to switch `python -m export` to another job -> the command that does it now.
OLD_SPELLINGS = {
    "--attach-weights": "python -m export attach BUNDLE --weights SOURCE",
    "--savedmodel": "python -m export savedmodel BUNDLE --out DIR",
    "--lora": "python -m export lora FILE --bundle BUNDLE --out ADAPTER.safetensors",
}


def old_spelling(argv: list[str]) -> str | None:
    """The one-line answer to a build command line that uses an old job flag (OLD_SPELLINGS), or None."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in OLD_SPELLINGS:
            return f"{flag} is now a command: {OLD_SPELLINGS[flag]}"
    return None


class CommandParser(argparse.ArgumentParser):
    """A command's parser whose usage errors are one line, exit 2 (its --help shows the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def attach_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m export attach",
                      description="Add a checkpoint's weights to a bundle exported with --no-weights (its programs are "
                                  "kept; the weights are checked against them, cast and quantized as the bundle was "
                                  "exported).")
    p.add_argument("bundle", type=Path, metavar="BUNDLE", help="the --no-weights bundle to add the weights to")
    p.add_argument("--weights", required=True, metavar="SOURCE",
                   help="the checkpoint (a diffusers-format directory or hub id) whose weights to add")
    flags.add_quantize(p, ": the mode the bundle was exported with (the default)")
    flags.add_weight_sources(p)
    flags.add_force_quiet(p, "weights already attached")
    return p


def savedmodel_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m export savedmodel",
                      description="Write a finished cpu/cuda bundle as a TensorFlow SavedModel (TF Serving layout: "
                                  "OUT/1/saved_model.pb); needs the savedmodel extra, not torch.")
    p.add_argument("bundle", type=Path, metavar="BUNDLE", help="the bundle to convert")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="the SavedModel base directory TF Serving loads")
    p.add_argument("--validate", action="store_true",
                   help="run every signature in TF and in JAX and compare (cpu bundles)")
    flags.add_force_quiet(p, "--out")
    return p


def lora_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m export lora",
                      description="Convert a LoRA (any format diffusers' Wan loader reads, .safetensors) into an "
                                  "adapter for one bundle, which the runtime merges at load or switches per run.")
    p.add_argument("source", type=Path, metavar="FILE", help="the LoRA (.safetensors, or a directory holding one)")
    p.add_argument("--bundle", type=Path, required=True, help="the bundle the adapter is for")
    p.add_argument("--out", type=Path, required=True, metavar="ADAPTER",
                   help="the adapter file to write (.safetensors)")
    p.add_argument("--lora-into", choices=("transformer", "transformer_2"), default=None,
                   help="load the LoRA's `transformer` keys into this expert (diffusers' load_into_transformer_2; "
                        "e.g. a Wan 2.2 low-noise LoRA)")
    flags.add_force_quiet(p, "--out")
    return p


def attach(args: argparse.Namespace) -> int:
    from runtime import manifest as mf

    from .attach import attach_weights
    from .options import parse_defaults
    from .source import load, with_vae_file

    with hub.errors_explained(args.weights, "--weights", args.revision):
        t0 = time.perf_counter()
        if Path(args.weights).is_file() and args.weights.endswith(".safetensors"):
            raise UserError(f"--weights {args.weights} is one file: give the whole diffusers-format checkpoint as "
                            "--weights (for the text encoder, VAE and tokenizer) and a pre-quantized DiT file as "
                            "--dit-weights")
        run_defaults, merges = parse_defaults(args.defaults), flags.merges(args)
        dtype = mf.read(args.bundle).dtype
        src = load(args.weights, dtype, args.revision)
        if args.vae is not None:
            src = with_vae_file(src, args.vae)
        manifest = attach_weights(args.bundle, src, force=args.force,
                                  quantize=args.quantize, dit_weights=args.dit_weights or [], defaults=run_defaults,
                                  merges=merges, tiny_decoder=flags.tiny_decoder(args))
    logging.getLogger("export").info("attached weights to %s (bundle %s) in %.1f s", args.bundle,
                                     manifest.bundle_id, time.perf_counter() - t0)
    return 0


def savedmodel(args: argparse.Namespace) -> int:
    from .savedmodel import convert

    t0 = time.perf_counter()
    info = convert(args.bundle, args.out, force=args.force, validate=args.validate)
    logging.getLogger("export").info("wrote %s (SavedModel of bundle %s, %d signatures) in %.1f s", args.out,
                                     info["bundle_id"], len(info["signatures"]), time.perf_counter() - t0)
    return 0


def lora(args: argparse.Namespace) -> int:
    from .lora import convert

    if not (args.bundle / "manifest.json").is_file():
        raise UserError(f"--bundle {args.bundle} is not a bundle (no manifest.json)")
    convert(args.source, args.bundle, args.out, into=args.lora_into, force=args.force)
    return 0


def precompile_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m export precompile",
                      description="Compile every program of a bundle for its target and write the executables into "
                                  "it, so that a host whose compiler, devices and CPU match loads them instead of "
                                  "compiling (cpu: here; TPU: with libtpu's compile-only devices, the tpu extra; "
                                  "cuda: on a machine with the GPUs). Weights are not needed.")
    p.add_argument("bundle", type=Path, metavar="BUNDLE", help="the bundle to precompile (its executables replaced)")
    p.add_argument("-q", "--quiet", action="store_true", help="log only warnings and errors")
    return p


def precompile(args: argparse.Namespace) -> int:
    from runtime import manifest as mf

    from .precompile import precompile as run

    if not (args.bundle / mf.MANIFEST_FILE).is_file():
        raise UserError(f"{args.bundle} is not a bundle (no manifest.json)")
    if mf.read(args.bundle).target.platform != "cuda":  # cpu and TPU bundles compile on this machine's CPU
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    manifest = run(args.bundle)
    logging.getLogger("export").info("precompiled %s (bundle %s) in %.1f s", args.bundle, manifest.bundle_id,
                                     time.perf_counter() - t0)
    return 0


# command -> (what it does, in the build's --help; its parser; what runs it)
COMMANDS: dict[str, tuple[str, Callable[[], argparse.ArgumentParser], Callable[[argparse.Namespace], int]]] = {
    "attach": ("add a checkpoint's weights to a --no-weights bundle", attach_parser, attach),
    "savedmodel": ("write a bundle as a TensorFlow SavedModel (TF Serving)", savedmodel_parser, savedmodel),
    "lora": ("convert a LoRA into an adapter for a bundle", lora_parser, lora),
    "precompile": ("compile a bundle's programs for its target into it", precompile_parser, precompile),
}


def epilog() -> str:
    """The commands, as the build's --help lists them."""
    width = max(map(len, COMMANDS))
    return ("other commands (each with its own --help: python -m export COMMAND --help):\n"
            + "\n".join(f"  {name:<{width}}  {summary}" for name, (summary, _, _) in COMMANDS.items()))
