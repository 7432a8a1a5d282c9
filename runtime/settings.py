"""Denoising settings: defaults from the manifest, checked in one place (numpy only, no jax).

Shared by the runtime's pipeline and by clients that run a bundle's programs elsewhere
(tools/tf_generate.py runs them from a TensorFlow SavedModel).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import samplers, scheduler
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
    sampler: str = "unipc"  # runtime/samplers.py
    sigmas: tuple[float, ...] | None = None  # custom sigmas, one per step, before the flow shift
    flow_map: bool = False  # the DiT is a flow-map model (kinds.Kind.flow_map): its euler is the flow map's, r = t

    @property
    def mean_velocity(self) -> bool:
        """The DiT is told the step's target timestep r (the next sigma): AnyFlowPipeline's use_mean_velocity. With
        sampler euler on a flow-map model, r = t."""
        return self.flow_map and self.sampler == "flowmap"

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps": self.steps, "guidance": self.guidance, "guidance_2": self.guidance_2,
                "flow_shift": self.flow_shift, "sampler": self.sampler,
                "sigmas": None if self.sigmas is None else list(self.sigmas)}

    def guidance_of(self, expert: int) -> float:
        return self.guidance if expert == 0 or self.guidance_2 is None else self.guidance_2

    def plan(self, config: scheduler.UniPCConfig, start: int = 0) -> scheduler.Plan:
        """The timesteps and coefficient rows of these settings (runtime/samplers.py), from step `start` on (a flow-map
        model's euler steps on the flow map's schedule: the update is the same, only r differs)."""
        return samplers.plan("flowmap" if self.flow_map else self.sampler, self.steps, self.flow_shift, config,
                             self.sigmas, start)


def resolve(defaults: Defaults, kind: Kind, config: scheduler.UniPCConfig, seed: int = 0, steps: int | None = None,
            guidance: float | None = None, flow_shift: float | None = None,
            guidance_2: float | None = None, sampler: str | None = None,
            sigmas: Sequence[float] | None = None) -> DenoiseSettings:
    """The settings of one run, the bundle's defaults filling what is None; bad values raise UserError.

    The bundle's default sigmas go with its default step count: they apply when neither `steps` nor `sigmas` is
    given. Given `sigmas` set the step count (and must have `steps` of them when both are given)."""
    sampler = samplers.check_sampler(defaults.sampler if sampler is None else sampler, kind.flow_map)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1):
        raise UserError(f"steps must be an integer >= 1, got {steps!r}")
    if sigmas is not None:
        sigmas = samplers.check_sigmas(sigmas, None if steps is None else int(steps))
        steps = len(sigmas)
    elif steps is None:
        steps, sigmas = defaults.steps, defaults.sigmas
    guidance = defaults.guidance if guidance is None else guidance
    flow_shift = defaults.flow_shift if flow_shift is None else flow_shift
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    for name, value in (("guidance", guidance), ("guidance_2", guidance_2)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise UserError(f"{name} must be a finite number >= 0, got {value!r}")
    if guidance_2 is not None and kind.experts < 2:
        raise UserError(f"guidance_2 (--guidance-2) is for two-expert models; this bundle is {kind.title} "
                        "with one expert: use guidance (--guidance)")
    if guidance_2 is None and kind.experts > 1:
        guidance_2 = defaults.guidance_2
    if isinstance(flow_shift, bool) or not isinstance(flow_shift, (int, float)) or not math.isfinite(flow_shift) \
            or flow_shift <= 0:
        raise UserError(f"flow shift must be a finite number > 0, got {flow_shift!r}")
    samplers.check_plan("flowmap" if kind.flow_map else sampler, int(steps), float(flow_shift), config, sigmas,
                        defaults.flow_shift)
    return DenoiseSettings(int(seed), int(steps), float(guidance), float(flow_shift),
                           None if guidance_2 is None else float(guidance_2), sampler, sigmas, kind.flow_map)


def expert_of(timestep: float, kind: Kind, boundary_ratio: float | None, config: scheduler.UniPCConfig) -> int:
    """0 (`transformer`, high noise) where t >= boundary_ratio x num_train_timesteps, else 1 (`transformer_2`)."""
    if kind.experts == 1 or boundary_ratio is None:
        return 0
    return 0 if timestep >= boundary_ratio * config.num_train_timesteps else 1
