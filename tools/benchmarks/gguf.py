"""GGUF DiT files (export --dit-weights FILE.gguf) against bf16: bytes and weight error, on the Wan 2.1 1.3B's shape.

The blocks' linear layers of the 1.3B (dim 1536, ffn 8960: self- and cross-attention q, k, v, o [1536, 1536], ffn.0
[8960, 1536], ffn.2 [1536, 8960]; 46.4 M parameters a block, what GGUF files quantize and export --quantize stores
in 8 bits) for --blocks of its 30 blocks, random: each row normal with its own standard deviation (0.02 x a
log-normal factor, sigma 0.5, so that rows differ as trained weights' do), rounded to bf16, the reference. Written as
GGUF files with the gguf package (Q8_0) and tools/gguf_quants.py (Q4_K, a min/max fit per sub-block: a little worse
than llama.cpp's search), read back with export's reader (export/gguf_file.py), then stored as a bundle stores them:
dequantized to bf16, or quantized per row to int8 (--quantize int8), as export does.

bytes: the GGUF file on disk and the bundle's tensors (int8 + a float32 scale per row, or bf16), for the blocks
measured and scaled to the model's 30 (the norms, biases and modulation, 0.2 % of the blocks' bytes, are not
counted). PSNR: 10 log10(peak^2 / MSE) against the bf16 weights, peak the largest |w|, over every value measured;
relative error: ||w' - w|| / ||w||. Deterministic: --repeats is not used.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .common import Report, Table, add_common, log

DIM, FFN, BLOCKS = 1536, 8960, 30
LAYERS = {**{f"{a}.{p}": (DIM, DIM) for a in ("self_attn", "cross_attn") for p in "qkvo"},
          "ffn.0": (FFN, DIM), "ffn.2": (DIM, FFN)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=1, devices=("cpu",))
    p.add_argument("--blocks", type=int, default=2, help="blocks of the 1.3B's 30 to build and measure (default 2)")
    p.add_argument("--seed", type=int, default=0)


def weights(blocks: int, seed: int) -> dict[str, np.ndarray]:
    """The blocks' linear weights in the original Wan names, bf16 values held in float32."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = {}
    for b in range(blocks):
        for layer, (rows, cols) in LAYERS.items():
            std = 0.02 * rng.lognormal(0.0, 0.5, (rows, 1)).astype(np.float32)
            w = rng.standard_normal((rows, cols), np.float32) * std
            out[f"blocks.{b}.{layer}.weight"] = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    return out


def _errors(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> tuple[float, float]:
    """(PSNR in dB, relative error) of `got` against `ref` over every value."""
    se = sum(float(np.sum((got[k].astype(np.float64) - ref[k]) ** 2)) for k in ref)
    n = sum(v.size for v in ref.values())
    norm = sum(float(np.sum(ref[k].astype(np.float64) ** 2)) for k in ref)
    peak = max(float(np.abs(v).max()) for v in ref.values())
    return (math.inf if se == 0 else 10 * math.log10(peak * peak / (se / n))), math.sqrt(se / norm)


def _as_int8(w: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """Each weight quantized per row as export's --quantize int8 stores it (export/quantize.py), dequantized back;
    and the bytes stored (int8 values, a float32 scale per row)."""
    import torch

    from export.quantize import quantize_tensor

    out, nbytes = {}, 0
    for k, v in w.items():
        q, scale = quantize_tensor(torch.from_numpy(v), "int8")
        out[k] = (q.float() * scale).numpy()
        nbytes += q.numel() + scale.numel() * 4
    return out, nbytes


def _as_bf16(w: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    import ml_dtypes

    return ({k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in w.items()},
            sum(v.size * 2 for v in w.values()))


def _read(path: Path) -> dict[str, np.ndarray]:
    """A GGUF file dequantized by export's reader (the gguf package's dequantizers, float32)."""
    from export.gguf_file import GgufFile

    src = GgufFile(path)
    return {name: src.tensor(name) for name in src.entries}


def run(args: Any) -> Report:
    import gguf_quants

    if args.blocks < 1 or args.blocks > BLOCKS:
        from .common import Usage

        raise Usage(f"--blocks must be in 1..{BLOCKS}")
    ref = weights(args.blocks, args.seed)
    scale = BLOCKS / args.blocks
    rows: list[tuple[str, int | None, int, tuple[float, float]]] = []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        int8, nbytes = _as_int8(ref)
        rows.append(("bf16 checkpoint -> int8 (export --quantize int8)", None, nbytes, _errors(ref, int8)))
        for qtype in ("Q8_0", "Q4_K"):
            log(f"writing and reading {args.blocks} block(s) as {qtype}")
            path = gguf_quants.write(Path(tmp) / f"{qtype}.gguf", {k: (v, qtype) for k, v in ref.items()})
            file_bytes = path.stat().st_size
            deq = _read(path)
            for label, (got, nbytes) in ((f"{qtype} -> int8 (--quantize int8)", _as_int8(deq)),
                                         (f"{qtype} -> bf16 (dequantized)", _as_bf16(deq))):
                rows.append((label, file_bytes, nbytes, _errors(ref, got)))
    bf16_bytes = sum(v.size * 2 for v in ref.values())
    table = Table(f"GGUF DiT weights against bf16: the 1.3B's block linears ({args.blocks} of {BLOCKS} blocks "
                  "measured, bytes scaled to 30)",
                  ["stored as", "GGUF file (30 blocks)", "bundle (30 blocks)", "vs bf16", "PSNR (dB)",
                   "relative error"])
    table.add("bf16 (the reference)", "-", f"{bf16_bytes * scale / 1e9:.2f} GB", "1.00x", "inf", "0")
    for label, file_bytes, nbytes, (db, rel) in rows:
        table.add(label, "-" if file_bytes is None else f"{file_bytes * scale / 1e9:.2f} GB",
                  f"{nbytes * scale / 1e9:.2f} GB", f"{nbytes / bf16_bytes:.2f}x", f"{db:.1f}", f"{rel:.4f}")
    table.notes.append(f"Random weights (seed {args.seed}), normal per row with a log-normal spread of row scales; "
                       "Q4_K by tools/gguf_quants.py's min/max fit, not llama.cpp's search.")
    raw = {"blocks": args.blocks, "bf16_bytes": bf16_bytes,
           "rows": [{"stored_as": r[0], "file_bytes": r[1], "bundle_bytes": r[2], "psnr_db": r[3][0],
                     "relative_error": r[3][1]} for r in rows]}
    return Report([table], raw)
