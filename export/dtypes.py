"""`--dtype`: the DiT's and text encoder's dtype, and what `auto` chooses for the machine that builds the bundle.

A cpu bundle runs on a CPU like the one that builds it, so `auto` asks this machine's CPU. Measured end to end on the
1.3B widths: with native bf16 dots (AMX or AVX512-BF16), bf16 is faster (12.4 s against 18.0 s in fp32); on an AVX2
CPU without them, bf16 is emulated and fp32 is faster (21.9 s against 26.5 s). Accelerators run bf16 natively.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

DTYPES = ("bf16", "fp32", "auto")

# /proc/cpuinfo flags of native bf16 arithmetic: Intel AMX's bf16 tiles, AVX512's bf16 dot products
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU feature flags (Linux's /proc/cpuinfo `flags` line); none where it cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def choose_dtype(dtype: str, platform: str, flags: Iterable[str] | None = None) -> str:
    """`--dtype` as the bundle's dtype: bf16 and fp32 as given; auto, for a cpu target, bf16 where the CPU (`flags`,
    default this machine's) has native bf16 (NATIVE_BF16_FLAGS), else fp32; for other targets, bf16."""
    if dtype != "auto":
        return dtype
    if platform != "cpu":
        return "bf16"
    have = cpu_flags() if flags is None else frozenset(flags)
    return "bf16" if have & NATIVE_BF16_FLAGS else "fp32"
