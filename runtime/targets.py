"""Target presets: a platform plus a device mesh with axes (dp, sp, tp), created in that order.

The export traces every stage under the target's mesh and records it in the
manifest; the runtime rebuilds the same mesh from the devices it finds.

dp carries the classifier-free-guidance halves (and the batch), sp the query
sequence of self-attention, tp the attention heads and MLP features (DESIGN.md
section 5). The TPU presets follow the seeds: v6e-8 runs dp=2 x tp=4.

The multi-GPU presets are for one NVLink node of H100s or H200s (80 / 141 GB each) and use
the TPU presets' sharding rules (export/sharding.py), with plain-XLA attention (the Pallas
kernel is TPU-only; cuDNN's attention cannot be lowered on a CPU build host). dp=2 comes
first because the two CFG halves need no communication at all: cuda-2 keeps the whole DiT
on each GPU (the 14B in bf16 is 28.6 GB), and tp splits the weights and heads only beyond
that (cuda-4: dp=2 x tp=2; cuda-8: dp=2 x tp=4, as tpu-v6e-8), so that tp's all-reduces
stay within 2 or 4 GPUs. Every Wan head count (12, 24, 40) divides over tp=4. No device
kind is recorded: one bundle runs on either card.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import UserError
from .manifest import Target

AXES = ("dp", "sp", "tp")


def _t(name: str, platform: str, dp: int, sp: int, tp: int, device_kind: str = "") -> Target:
    return Target(name=name, platform=platform, mesh={"dp": dp, "sp": sp, "tp": tp}, device_kind=device_kind)


PRESETS: dict[str, Target] = {t.name: t for t in (
    _t("cpu", "cpu", 1, 1, 1),
    # 8 fake host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8): every axis > 1, for tests.
    _t("cpu-8", "cpu", 2, 2, 2),
    _t("cuda", "cuda", 1, 1, 1),
    _t("cuda-2", "cuda", 2, 1, 1),
    _t("cuda-4", "cuda", 2, 1, 2),
    _t("cuda-8", "cuda", 2, 1, 4),
    _t("tpu-v6e-4", "tpu", 2, 1, 2, "TPU v6 lite"),
    _t("tpu-v6e-8", "tpu", 2, 1, 4, "TPU v6 lite"),
    _t("tpu-v6e-16", "tpu", 2, 1, 8, "TPU v6 lite"),
    _t("tpu-v5e-8", "tpu", 2, 1, 4, "TPU v5 lite"),
    # A v4-8 slice has 4 chips (megacore: one JAX device per chip).
    _t("tpu-v4-8", "tpu", 2, 1, 2, "TPU v4"),
)}


def get(name: str) -> Target:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown target {name!r}: choose one of {', '.join(PRESETS)}") from None


def parse_mesh(text: str) -> dict[str, int]:
    """'dp=2,sp=1,tp=4' (any subset, missing axes are 1) -> {'dp': 2, 'sp': 1, 'tp': 4}."""
    sizes = {a: 1 for a in AXES}
    seen = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", part)
        if not m or m.group(1) not in AXES or int(m.group(2)) < 1 or m.group(1) in seen:
            raise UserError(f"--mesh {text!r} is not a list like dp=2,sp=1,tp=4 (axes dp, sp, tp; sizes >= 1)")
        seen.add(m.group(1))
        sizes[m.group(1)] = int(m.group(2))
    return sizes


def format_mesh(mesh: dict[str, int]) -> str:
    return ",".join(f"{a}={mesh[a]}" for a in AXES)


def resolve(name: str, mesh: str | None = None) -> Target:
    """The preset `name`, with its mesh replaced by `mesh` if given (same platform and device kind)."""
    target = get(name)
    if mesh is None:
        return target
    sizes = parse_mesh(mesh)
    return Target(name=f"{target.name}[{format_mesh(sizes)}]", platform=target.platform, mesh=sizes,
                  device_kind=target.device_kind)


@dataclass(frozen=True)
class Chip:
    """A TPU generation: what `runtime fit` compiles for (a compile-only topology of it) and checks against (HBM per
    chip), and the peak figures the roofline benchmark divides by (Google Cloud TPU pages)."""

    name: str  # the topology prefix: "v6e", "v5e", "v5p", "v4"
    hbm_gib: float  # per chip
    torus: int  # 2: a 2D torus (v5e, v6e), 3: 3D (v4, v5p)
    chip_config: str = ""  # "megacore": the chip's two TensorCores are one JAX device (v4, v5p)
    bf16_flops: float = 0.0  # peak per chip
    hbm_bytes_per_s: float = 0.0
    ici_bytes_per_s: float | None = None  # bidirectional; None: not published


CHIPS: dict[str, Chip] = {  # by jax device_kind
    "TPU v6 lite": Chip("v6e", 32, 2, bf16_flops=918e12, hbm_bytes_per_s=1638e9, ici_bytes_per_s=800e9),
    "TPU v5 lite": Chip("v5e", 16, 2, bf16_flops=197e12, hbm_bytes_per_s=819e9, ici_bytes_per_s=400e9),
    "TPU v5": Chip("v5p", 95, 3, "megacore", bf16_flops=459e12, hbm_bytes_per_s=2765e9, ici_bytes_per_s=1200e9),
    "TPU v4": Chip("v4", 32, 3, "megacore", bf16_flops=275e12, hbm_bytes_per_s=1200e9),
}


def chip(target: Target) -> Chip:
    """The TPU generation of a TPU target (UserError for other platforms or an unknown device kind)."""
    if target.platform != "tpu":
        raise UserError(f"target {target.name} is for {target.platform}, not a TPU slice")
    if target.device_kind not in CHIPS:
        raise UserError(f"target {target.name} names TPU device kind {target.device_kind!r}, which this wan-aot does "
                        f"not know ({', '.join(CHIPS)}): upgrade wan-aot")
    return CHIPS[target.device_kind]


def topology(target: Target) -> str:
    """The slice a TPU target runs on, as jax's compile-only topologies name it: chips on a 2D (v5e, v6e) or 3D (v4,
    v5p) torus of hosts of 2x2(x1) chips, e.g. tpu-v6e-8 -> "v6e:2x4", tpu-v4-8 (4 chips) -> "v4:2x2x1". UserError
    for a device count no such slice has."""
    c, n = chip(target), target.num_devices
    if n < 4 or n & (n - 1):
        raise UserError(f"target {target.name} has {n} devices: a {c.name} slice this runtime can compile for has 4, "
                        "8, 16, ... (a power of two, at least one host of 4 chips)")
    dims = [2, 2] if c.torus == 2 else [2, 2, 1]  # one host's chips, then each doubling doubles the shortest side
    for _ in range(int(math.log2(n)) - 2):
        i = max(j for j, d in enumerate(dims) if d == min(dims))
        dims[i] *= 2
    return f"{c.name}:{'x'.join(map(str, dims))}"
