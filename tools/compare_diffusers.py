"""Compare a bundle against diffusers' WanPipeline on the same checkpoint and initial latents.

    python tools/compare_diffusers.py --checkpoint DIR --bundle artifacts/NAME [--steps 4] [--guidance 5]

Prints the max abs / mean abs differences of prompt embeddings, final latents and
frames. The bundle must have been exported from --checkpoint (any dtype; the
reference runs in the bundle's dtype, VAE in fp32). `--checkpoint tiny` builds the
embedded model in memory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="diffusers-format directory (or tiny / tiny-wide)")
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--prompt", default="a cat playing piano in a jazz club, cinematic")
    p.add_argument("--negative-prompt", default="blurry, low quality")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    import runtime
    from export import tiny

    pipe = runtime.load(args.bundle)
    g = pipe.geometry
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[pipe.manifest.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(tiny.save(args.checkpoint, Path(tmp)) if args.checkpoint in tiny.VARIANTS else args.checkpoint)
        vae = AutoencoderKLWan.from_pretrained(ckpt, subfolder="vae", dtype=torch.float32)
        ref = WanPipeline.from_pretrained(ckpt, vae=vae, dtype=dtype)

    t0 = time.perf_counter()
    embeds = pipe.encode(args.prompt, args.negative_prompt)
    latents = pipe.denoise(embeds, seed=args.seed, steps=args.steps, guidance=args.guidance, progress=False)
    frames = pipe.decode(latents)
    t_runtime = time.perf_counter() - t0

    init = torch.from_numpy(pipe.initial_latents(args.seed).copy())
    call = dict(prompt=args.prompt, negative_prompt=args.negative_prompt, height=g.height, width=g.width,
                num_frames=g.frames, num_inference_steps=args.steps, guidance_scale=args.guidance,
                max_sequence_length=g.max_sequence_length, latents=init)
    t0 = time.perf_counter()
    with torch.no_grad():
        pe, ne = ref.encode_prompt(args.prompt, args.negative_prompt, max_sequence_length=g.max_sequence_length)
        ref_latents = ref(**call, output_type="latent").frames.float().numpy()
        ref_frames = ref(**call, output_type="np").frames
    t_ref = time.perf_counter() - t0

    def row(name: str, a: np.ndarray, b: np.ndarray) -> None:
        d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        print(f"{name:<24} max abs {d.max():.3e}   mean abs {d.mean():.3e}   ref max |x| {np.abs(b).max():.3g}")

    print(f"bundle {pipe.bundle_id} ({pipe.manifest.dtype}, {g.width}x{g.height}, {g.frames} frames), "
          f"{args.steps} steps, guidance {args.guidance}")
    row("prompt_embeds", embeds["prompt_embeds"], pe.float().numpy())
    row("negative_prompt_embeds", embeds["negative_prompt_embeds"], ne.float().numpy())
    row("latents", latents, ref_latents)
    row("frames", frames, ref_frames)
    print(f"wall time incl. compile: runtime {t_runtime:.1f} s, diffusers (two calls) {t_ref:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
