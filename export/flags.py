"""The flags `python -m export` (the build) and `python -m export attach` share, declared once, and what they parse to.

Both commands read a checkpoint and write weights into a bundle, so both take the same weight options: a DiT from
another file, a VAE from another file, LoRAs merged in, a tiny decoder, run defaults, the hub revision. Each command
has its own parser (export/__main__.py, export/commands.py); these functions add the common flags to it, so a flag's
spelling and help are written in one place, and a flag a command does not take is refused by that command's parser.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from runtime.errors import UserError

from .quantize import MODES

DIT_WEIGHTS_HELP = (
    "the DiT's weights from this file instead of the checkpoint's{with_}, in the "
    "original Wan layout (`blocks.N.self_attn.q.weight`, as lightx2v and ComfyUI ship full and "
    "step-distilled DiTs; a .safetensors file or a directory of them), or a training run's "
    "torch.distributed.checkpoint folder (TorchTitan's step-N/, or its parent: the highest step; "
    "the model's keys only): bf16/fp32, cast to the bundle's dtype, or pre-quantized (int8 / "
    "float8_e4m3fn with a per-row weight_scale) for a bundle of that --quantize mode, used as is; "
    "or a .gguf file (city96's layout: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K), "
    "dequantized to the bundle's dtype or requantized per row for --quantize; "
    "give it once per expert, the high-noise one first")


def add_quantize(p: argparse.ArgumentParser, help_tail: str = "") -> None:
    """--quantize MODE (export/quantize.py MODES)."""
    p.add_argument("--quantize", choices=MODES, default=None,
                   help="store the DiT's and the encoders' linear layers in 8 bits with a scale per output channel "
                        "(int8 or fp8: weights only, dequantized next to the matmul; int8-dynamic: int8 weights and "
                        "int8 activations per token, int8 x int8 -> int32 dots)" + help_tail)


def add_weight_sources(p: argparse.ArgumentParser, dit_weights_with: str = "") -> None:
    """--dit-weights (`dit_weights_with`: when it applies, said in its help), --vae, --defaults, --merge-lora,
    --merge-lora-2, --tiny-decoder, --tiny-decoder-latents, --revision: where a bundle's weights and run defaults come
    from besides the checkpoint."""
    p.add_argument("--dit-weights", action="append", type=Path, metavar="FILE",
                   help=DIT_WEIGHTS_HELP.format(with_=dit_weights_with))
    p.add_argument("--vae", type=Path, metavar="FILE",
                   help="replace the checkpoint's VAE (encoder and decoder) by a Wan 2.1 VAE in the original Wan "
                        "layout (`encoder.downsamples.N.residual.2.weight`, `decoder.upsamples.N...`; a .safetensors "
                        "file such as lightx2v's LightVAE lightvaew2_1 or Wan2.1_VAE), its widths read from its "
                        "tensors; its latent space (z_dim, scales) must be the model's, whose latents_mean/std it "
                        "keeps")
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
                   help="with --tiny-decoder: what the tiny decoder takes: the DiT's normalised latents (taew) or raw "
                        "VAE latents (lighttae: z*std + mean first); default: raw when the file name holds "
                        "'lighttae'")
    p.add_argument("--revision", default=None, help="hub revision (hub ids only)")


def add_force_quiet(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--force", action="store_true", help=f"replace {what} if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no info logs (errors still print)")


# Flags that mean something only beside another one of the same command: (flag's dest, the flag, what it needs).
# One table, read by `check_needs`, instead of a check written at each place a flag is used.
NEEDS = (("tiny_decoder_latents", "--tiny-decoder-latents", "tiny_decoder", "--tiny-decoder FILE"),
         ("hbm", "--hbm", "fit", "--fit"))


def check_needs(args: argparse.Namespace) -> None:
    """Refuse, in one line, a flag given without the flag of the same command it needs (NEEDS)."""
    for dest, flag, needed, needed_flag in NEEDS:
        if getattr(args, dest, None) is not None and not getattr(args, needed, None):
            raise UserError(f"{flag} goes with {needed_flag}")


def merges(args: argparse.Namespace) -> list:
    """--merge-lora / --merge-lora-2 as (file, scale, expert) (export/lora.py); a missing file fails here."""
    from .lora import parse_merge

    return ([parse_merge(t, None) for t in args.merge_lora]
            + [parse_merge(t, "transformer_2") for t in args.merge_lora_2])


def tiny_decoder(args: argparse.Namespace) -> Any:
    """--tiny-decoder FILE [--tiny-decoder-latents normalized|raw] as the file read (options.TinyDecoderFile), or
    None; a file that is not a tiny decoder fails here, before the model is read."""
    if args.tiny_decoder is None:
        return None
    from .options import TinyDecoderFile
    from .tiny_decoder import default_latents, read

    return TinyDecoderFile(args.tiny_decoder, args.tiny_decoder_latents or default_latents(args.tiny_decoder),
                           read(args.tiny_decoder))
