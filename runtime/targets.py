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

import re

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
