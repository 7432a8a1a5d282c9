"""Denoising settings: defaults from the manifest, checked in one place (numpy only, no jax).

Shared by the runtime's pipeline and by clients that run a bundle's programs elsewhere
(tools/tf_generate.py runs them from a TensorFlow SavedModel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import scheduler
from .errors import UserError
from .kinds import Kind
from .manifest import Defaults

MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class DenoiseSettings:
    seed: int
    steps: int
    guidance: float
    flow_shift: float
    guidance_2: float | None = None  # the second expert's; None: as `guidance` (diffusers' default)

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps": self.steps, "guidance": self.guidance, "guidance_2": self.guidance_2,
                "flow_shift": self.flow_shift}

    def guidance_of(self, expert: int) -> float:
        return self.guidance if expert == 0 or self.guidance_2 is None else self.guidance_2


def resolve(defaults: Defaults, kind: Kind, config: scheduler.UniPCConfig, seed: int = 0, steps: int | None = None,
            guidance: float | None = None, flow_shift: float | None = None,
            guidance_2: float | None = None) -> DenoiseSettings:
    """The settings of one run, the bundle's defaults filling what is None; bad values raise UserError."""
    steps = defaults.steps if steps is None else steps
    guidance = defaults.guidance if guidance is None else guidance
    flow_shift = defaults.flow_shift if flow_shift is None else flow_shift
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise UserError(f"steps must be an integer >= 1, got {steps!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    for name, value in (("guidance", guidance), ("guidance_2", guidance_2)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise UserError(f"{name} must be a finite number >= 0, got {value!r}")
    if guidance_2 is not None and kind.experts < 2:
        raise UserError(f"guidance_2 (--guidance-2) is for two-expert models; this bundle is {kind.title} "
                        "with one expert: use guidance (--guidance)")
    if isinstance(flow_shift, bool) or not isinstance(flow_shift, (int, float)) or not math.isfinite(flow_shift) \
            or flow_shift <= 0:
        raise UserError(f"flow shift must be a finite number > 0, got {flow_shift!r}")
    scheduler.check_plan(int(steps), float(flow_shift), config)
    return DenoiseSettings(int(seed), int(steps), float(guidance), float(flow_shift),
                           None if guidance_2 is None else float(guidance_2))


def expert_of(timestep: int, kind: Kind, boundary_ratio: float | None, config: scheduler.UniPCConfig) -> int:
    """0 (`transformer`, high noise) where t >= boundary_ratio x num_train_timesteps, else 1 (`transformer_2`)."""
    if kind.experts == 1 or boundary_ratio is None:
        return 0
    return 0 if timestep >= boundary_ratio * config.num_train_timesteps else 1
