"""Compare a bundle against diffusers (WanPipeline / WanImageToVideoPipeline) on the same checkpoint,
images and initial latents; works for every model kind (runtime/kinds.py).

    python tools/compare_diffusers.py --checkpoint DIR --bundle artifacts/NAME [--steps 4] [--guidance 5]
        [--guidance-2 3] [--image first.png] [--last-image last.png]

Prints the max abs / mean abs differences of prompt embeddings, image conditioning,
final latents and frames. The bundle must have been exported from --checkpoint (any
dtype; the reference runs in the bundle's dtype, VAE in fp32). `--checkpoint tiny-i2v`
(any embedded variant) builds the embedded model. Image bundles without --image get a
generated test image; TI2V bundles run text-to-video unless --image is given.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _test_image(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(1, width - 1), y * 255 / max(1, height - 1), (x + y) % 64 * 4], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="diffusers-format directory (or an embedded variant)")
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--prompt", default="a cat playing piano in a jazz club, cinematic")
    p.add_argument("--negative-prompt", default="blurry, low quality")
    p.add_argument("--image", type=Path, default=None)
    p.add_argument("--last-image", type=Path, default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--guidance-2", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

    import runtime
    from export import tiny
    from runtime.images import load_image

    pipe = runtime.load(args.bundle)
    g, kind = pipe.geometry, pipe.kind
    images = {}
    if args.image is not None or kind.image == "required":
        images["image"] = load_image(args.image) if args.image else _test_image(g.width + 6, g.height - 4, 1)
    if kind.last_image:
        images["last_image"] = load_image(args.last_image) if args.last_image else _test_image(g.width, g.height, 2)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[pipe.manifest.dtype]
    cls = WanImageToVideoPipeline if images else WanPipeline
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(tiny.save(args.checkpoint, Path(tmp)) if args.checkpoint in tiny.VARIANTS else args.checkpoint)
        vae = AutoencoderKLWan.from_pretrained(ckpt, subfolder="vae", dtype=torch.float32)
        ref = cls.from_pretrained(ckpt, vae=vae, dtype=dtype)
    ref.set_progress_bar_config(disable=True)

    t0 = time.perf_counter()
    embeds = pipe.encode(args.prompt, args.negative_prompt, **images)
    latents = pipe.denoise(embeds, seed=args.seed, steps=args.steps, guidance=args.guidance,
                           guidance_2=args.guidance_2, progress=False)
    frames = pipe.decode(latents)
    t_runtime = time.perf_counter() - t0

    init = torch.from_numpy(pipe.initial_latents(args.seed).copy())
    call = dict(prompt=args.prompt, negative_prompt=args.negative_prompt, height=g.height, width=g.width,
                num_frames=g.frames, num_inference_steps=args.steps, guidance_scale=args.guidance,
                max_sequence_length=g.max_sequence_length, latents=init, **images)
    if args.guidance_2 is not None:
        call["guidance_scale_2"] = args.guidance_2
    t0 = time.perf_counter()
    with torch.no_grad():
        pe, ne = ref.encode_prompt(args.prompt, args.negative_prompt, max_sequence_length=g.max_sequence_length)
        image_embeds = None
        if kind.image_encoder:
            pair = [images["image"], images["last_image"]] if kind.last_image else images["image"]
            image_embeds = ref.encode_image(pair, "cpu").float().numpy()
        ref_latents = ref(**call, output_type="latent").frames.float().numpy()
        ref_frames = ref(**call, output_type="np").frames
    t_ref = time.perf_counter() - t0

    def row(name: str, a: np.ndarray, b: np.ndarray) -> None:
        d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        print(f"{name:<24} max abs {d.max():.3e}   mean abs {d.mean():.3e}   ref max |x| {np.abs(b).max():.3g}")

    print(f"bundle {pipe.bundle_id}: {kind.title} ({pipe.manifest.dtype}, {g.width}x{g.height}, {g.frames} frames), "
          f"{args.steps} steps, guidance {args.guidance}"
          + (f" / {args.guidance_2}" if args.guidance_2 is not None else "")
          + (f", {' + '.join(images)}" if images else ""))
    row("prompt_embeds", embeds["prompt_embeds"], pe.float().numpy())
    row("negative_prompt_embeds", embeds["negative_prompt_embeds"], ne.float().numpy())
    if image_embeds is not None:
        row("image_embeds", embeds["image_embeds"][: image_embeds.shape[0]], image_embeds)
    row("latents", latents, ref_latents)
    row("frames", frames, ref_frames)
    print(f"wall time incl. compile: runtime {t_runtime:.1f} s, diffusers (two calls) {t_ref:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
