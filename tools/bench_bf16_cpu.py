"""Why is XLA CPU slower than torch in bf16, and what helps? Side by side in one run.

    python tools/bench_bf16_cpu.py [--rows 1024] [--repeats 7]

The workload is the matmul chain of one Wan2.1-1.3B DiT block at its real widths (q, k, v, o:
1536x1536; FFN: 1536x8960 and back) on `rows` tokens. Variants: torch fp32 / bf16; JAX fp32;
JAX bf16 as exported (bf16 dots); JAX bf16 storage with fp32 compute (upcast before each dot);
JAX bf16 dots with fp32 accumulation; and the bf16 program under XLA CPU flags that route dots
to other libraries. Each variant runs in its own process (XLA flags are per process). Prints
the median time of the chain, its GFLOP/s and the ratio to torch bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WIDTHS = [(1536, 1536)] * 4 + [(1536, 8960), (8960, 1536)]
FLAG_VARIANTS = {
    "jax bf16, --xla_cpu_use_onednn": "--xla_cpu_use_onednn=true",
    "jax bf16, --xla_cpu_experimental_onednn_custom_call": "--xla_cpu_experimental_onednn_custom_call=true",
    "jax bf16, --xla_cpu_use_xnnpack": "--xla_cpu_use_xnnpack=true",
    "jax bf16, --xla_cpu_enable_fast_math": "--xla_cpu_enable_fast_math=true",
}


def _torch(dtype_name: str, rows: int, repeats: int) -> list[float]:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(k, n, generator=g).to(dtype) * 0.02 for k, n in WIDTHS]
    x = torch.randn(rows, 1536, generator=g).to(dtype)

    def chain() -> list[torch.Tensor]:
        return [x @ w for w in ws[:4]] + [torch.nn.functional.gelu(x @ ws[4], approximate="tanh") @ ws[5]]

    with torch.no_grad():
        chain()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            chain()
            times.append(time.perf_counter() - t)
    return times


def _jax(mode: str, rows: int, repeats: int) -> list[float]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    store = jnp.float32 if mode == "fp32" else jnp.bfloat16
    ws = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, store) for k, n in WIDTHS]
    x = jnp.asarray(rng.standard_normal((rows, 1536), np.float32), store)

    def dot(a: jax.Array, b: jax.Array) -> jax.Array:
        if mode == "bf16-storage-fp32-compute":
            return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)).astype(store)
        if mode == "bf16-fp32-accumulate":
            return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(store)
        return jnp.dot(a, b)

    @jax.jit
    def chain(x: jax.Array, ws: list[jax.Array]) -> list[jax.Array]:
        return [dot(x, w) for w in ws[:4]] + [dot(jax.nn.gelu(dot(x, ws[4])), ws[5])]

    jax.block_until_ready(chain(x, ws))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(chain(x, ws))
        times.append(time.perf_counter() - t)
    return times


def child(variant: str, rows: int, repeats: int) -> list[float]:
    if variant.startswith("torch"):
        return _torch(variant.split()[1], rows, repeats)
    if variant in FLAG_VARIANTS:
        return _jax("bf16", rows, repeats)
    return _jax(variant.split(" ", 1)[1], rows, repeats)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    variants = ["torch fp32", "torch bf16", "jax fp32", "jax bf16", "jax bf16-storage-fp32-compute",
                "jax bf16-fp32-accumulate", *FLAG_VARIANTS]
    flops = sum(2 * args.rows * k * n for k, n in WIDTHS)
    medians = {}
    for v in variants:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        if v in FLAG_VARIANTS:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG_VARIANTS[v]).strip()
        proc = subprocess.run([sys.executable, __file__, "--child", v, str(args.rows), str(args.repeats)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{v:<50} failed: {proc.stderr.strip().splitlines()[-1][:100]}")
            continue
        medians[v] = statistics.median(json.loads(proc.stdout.strip().splitlines()[-1]))
    ref = medians.get("torch bf16")
    print(f"Wan2.1-1.3B block matmul chain, {args.rows} rows, {flops / 1e9:.1f} GFLOP, median of {args.repeats}")
    print(f"{'variant':<50} {'ms':>8} {'GFLOP/s':>9} {'vs torch bf16':>14}")
    for v, t in medians.items():
        print(f"{v:<50} {t * 1e3:>8.1f} {flops / t / 1e9:>9.0f} {t / ref if ref else float('nan'):>13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
