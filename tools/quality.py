"""How far a candidate bundle's videos are from a reference bundle's: same prompts, seeds and initial latents.

    python tools/quality.py --reference artifacts/tiny --candidate artifacts/tiny-int8
    python tools/quality.py --reference artifacts/wan-480p --candidate artifacts/wan-480p-fp8 \\
        --prompt "a cat playing piano" --prompt "a red car in the rain" --seeds 0 1 --steps 20 --json

For each prompt x seed: each bundle encodes the prompt with its own encoders (what a quantized text
encoder changes is part of what is measured), both start from the reference's initial latents, and
the decoded frames (float, in [0, 1]) are compared: PSNR (peak 1) and the largest absolute error in
8-bit levels; plus the relative L2 error of the first step's guided velocity, which isolates the
DiT's (and the encoders') error from its amplification over the steps. Any approximation can be
measured this way: quantized weights, MagCache (--magcache on the candidate), fewer steps, another sampler
(--candidate-sampler; the candidate may be the reference bundle itself):

    python tools/quality.py --reference B --candidate B --steps 10 --candidate-sampler euler
The two bundles must have the kind and shape compared (any target: a TPU bundle against a CPU one
on a TPU host).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = ("a cat playing the piano in a sunlit room", "a red car driving through the rain at night")


@dataclass(frozen=True)
class Row:
    prompt: str
    seed: int
    psnr_db: float
    max_error_levels: float  # of 255
    velocity_rel_error: float


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of frames in [0, 1] (inf where they are equal)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def rel_error(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def compare(reference: Any, candidate: Any, prompts: list[str], seeds: list[int], steps: int | None = None,
            guidance: float | None = None, size: str | None = None, frames: int | None = None,
            image: Any = None, last_image: Any = None, candidate_magcache: Any = None,
            reference_sampler: str | None = None, candidate_sampler: str | None = None) -> list[Row]:
    """Rows of the comparison of two loaded pipelines (runtime.load); each runs its sampler (None: its bundle's
    default)."""
    rows = []
    g = reference.shape(size, frames)
    for prompt in prompts:
        embeds = {}
        for name, p in (("ref", reference), ("cand", candidate)):
            embeds[name] = p.encode(prompt, "", image, last_image, g.size, g.frames)
        for seed in seeds:
            latents = reference.initial_latents(seed, g)
            v_ref = reference.first_velocity(embeds["ref"], seed, steps, guidance, latents=latents,
                                             sampler=reference_sampler)
            v_cand = candidate.first_velocity(embeds["cand"], seed, steps, guidance, latents=latents,
                                              sampler=candidate_sampler)
            out = {}
            for name, p, mc, sampler in (("ref", reference, None, reference_sampler),
                                         ("cand", candidate, candidate_magcache, candidate_sampler)):
                z = p.denoise(embeds[name], seed, steps, guidance, latents=latents, progress=False, magcache=mc,
                              sampler=sampler)
                out[name] = p.decode(z)
            rows.append(Row(prompt, seed, psnr(out["ref"], out["cand"]),
                            float(np.max(np.abs(out["ref"] - out["cand"]))) * 255, rel_error(v_ref, v_cand)))
    return rows


def summary(rows: list[Row]) -> dict[str, float]:
    return {"psnr_db_min": min(r.psnr_db for r in rows), "psnr_db_median": statistics.median(r.psnr_db for r in rows),
            "max_error_levels": max(r.max_error_levels for r in rows),
            "velocity_rel_error_max": max(r.velocity_rel_error for r in rows)}


def table(rows: list[Row]) -> str:
    lines = ["| prompt | seed | PSNR | max error (of 255) | first-step velocity rel. error |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.prompt[:40]} | {r.seed} | {r.psnr_db:.1f} dB | {r.max_error_levels:.1f} | "
                     f"{r.velocity_rel_error:.2e} |")
    s = summary(rows)
    lines.append(f"| **all** | | min {s['psnr_db_min']:.1f} dB, median {s['psnr_db_median']:.1f} dB | "
                 f"{s['max_error_levels']:.1f} | max {s['velocity_rel_error_max']:.2e} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", type=Path, required=True, help="the bundle taken as exact")
    p.add_argument("--candidate", type=Path, required=True, help="the bundle measured against it")
    p.add_argument("--prompt", action="append", help=f"repeatable (default: {len(PROMPTS)} built-in prompts)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the bundle's)")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--size", default=None, help="one of the bundles' shapes (default: the default shape)")
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--image", type=Path, default=None, help="first frame, for image-to-video kinds")
    p.add_argument("--last-image", type=Path, default=None, help="last frame, for first-last-frame kinds")
    p.add_argument("--magcache", type=Path, default=None, help="ratios JSON: run the candidate with MagCache")
    p.add_argument("--reference-sampler", default=None, help="unipc, euler or dpm++ (default: the bundle's)")
    p.add_argument("--candidate-sampler", default=None, help="unipc, euler or dpm++ (default: the bundle's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import runtime
    from runtime.errors import UserError

    try:
        ref, cand = runtime.load(args.reference), runtime.load(args.candidate)
        if ref.manifest.kind != cand.manifest.kind:
            raise UserError(f"the bundles are of different kinds ({ref.manifest.kind}, {cand.manifest.kind})")
        from runtime.magcache import load_ratios

        magcache = runtime.MagCache(load_ratios(args.magcache)) if args.magcache else None
        rows = compare(ref, cand, args.prompt or list(PROMPTS), args.seeds, args.steps, args.guidance, args.size,
                       args.frames, args.image, args.last_image, magcache, args.reference_sampler,
                       args.candidate_sampler)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"reference": str(args.reference), "candidate": str(args.candidate),
                          "rows": [asdict(r) for r in rows], "summary": summary(rows)}, indent=1))
    else:
        print(f"reference {args.reference} ({ref.manifest.quantize or ref.manifest.dtype}), candidate "
              f"{args.candidate} ({cand.manifest.quantize or cand.manifest.dtype})\n")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
