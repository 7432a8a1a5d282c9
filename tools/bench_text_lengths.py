"""What encoding prompts with the shortest text encoder program that holds them saves (kinds.text_lengths).

    python tools/bench_text_lengths.py [--layers 2] [--repeats 3] [--dtype fp32] [--max-sequence-length 512]

UMT5 at UMT5-XXL's widths (d_model 4096, 64 heads of 64, gated-GELU d_ff 10240), random weights, `--layers`
of its 24 (the whole encoder does not fit this machine in fp32; every layer costs the same, so the 24-layer
figure is the per-layer time x 24), with a 32k vocabulary (the embedding lookup's cost does not depend on it).
The export's own text encoder stage (export/text_encoder.py, bf16 dots accumulating in fp32 on CPU as a CPU
bundle's) is jitted and timed at each length a bundle has programs for, on a batch of 2 (prompt and negative
prompt), all in one process, lengths interleaved; prints the median per length, per layer, and the ratio to
the full length. Each length's embeddings of the real tokens are checked against the full length's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64)
XXL_LAYERS = 24


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--max-sequence-length", type=int, default=512)
    p.add_argument("--tokens", type=int, default=40, help="real tokens in the longer prompt (default 40)")
    args = p.parse_args()

    import jax
    import ml_dtypes
    import numpy as np
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from export import text_encoder
    from export.attention import AttentionConfig
    from export.trace import extract
    from runtime import kinds

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    module = UMT5EncoderModel(UMT5Config(
        vocab_size=32128, num_layers=args.layers, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, **XXL)).eval().to(dtype)
    with torch.no_grad():
        ex = extract(module, AttentionConfig(), cpu_dots=True)
        fn = jax.jit(text_encoder.build(ex))
        weights = {}
        for k, t in ex.weights.items():
            t = t.detach().contiguous()
            a = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
            weights[k] = jax.device_put(np.array(a, copy=True))
    del module

    L = args.max_sequence_length
    rng = np.random.default_rng(0)
    real = [args.tokens, max(1, args.tokens // 3)]  # prompt, negative prompt
    full_ids = np.zeros((2, L), np.int32)
    full_mask = np.zeros((2, L), np.int32)
    for i, n in enumerate(real):
        full_ids[i, :n] = rng.integers(2, 32128, n)
        full_mask[i, :n] = 1
    lengths = [n for n in kinds.text_lengths(L) if n >= max(real)]
    times: dict[int, list[float]] = {n: [] for n in lengths}
    outs = {}
    for n in lengths:  # compile, and keep each length's output
        outs[n] = np.asarray(fn(weights, full_ids[:, :n], full_mask[:, :n]), np.float32)
    for _ in range(args.repeats):
        for n in lengths:
            t = time.perf_counter()
            jax.block_until_ready(fn(weights, full_ids[:, :n], full_mask[:, :n]))
            times[n].append(time.perf_counter() - t)

    full = outs[L]
    print(f"UMT5 at XXL widths, {args.layers} layers, {args.dtype}, batch 2 (prompts of {real[0]} and {real[1]} "
          f"tokens), {args.repeats} repeats, medians")
    print(f"{'length':>7} {'s':>8} {'s/layer':>9} {'24 layers s':>12} {'vs ' + str(L):>8} {'max |diff|':>11}")
    for n in lengths:
        med = statistics.median(times[n])
        diff = float(np.abs(outs[n] - full[:, :n]).max())
        print(f"{n:>7} {med:>8.3f} {med / args.layers:>9.3f} {med / args.layers * XXL_LAYERS:>12.1f} "
              f"{med / statistics.median(times[L]):>8.2f} {diff:>11.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
