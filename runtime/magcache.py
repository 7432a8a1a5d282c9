"""MagCache's skip schedule, decided on the host (numpy only).

MagCache (https://github.com/Zehong-Ma/MagCache) skips the DiT's transformer blocks on a step when
the residual they would add is predictable from the last computed one: the calibrated magnitude
ratios of successive residuals, accumulated since the last computed step, say how far it has drifted.
The rule uses only the ratios and the step index, never the data, so the whole schedule is known
before the first step and each step runs one of two programs: a full step that also returns the
blocks' residual, or a cached step that adds the kept residual instead of running the blocks
(export/block_cache.py). The rule is diffusers' `MagCacheConfig` / `MagCacheHeadHook`, float32
arithmetic included, so the same steps are skipped.

Two-expert models: one ratio curve across all steps; each expert's phase keeps its own state, as
each transformer would under its own diffusers hook: retention counts from the phase's first step,
and the residual is reset at the boundary (the other expert's residual means nothing here).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UserError


@dataclass(frozen=True)
class MagCache:
    """diffusers' MagCacheConfig: `ratios` (its `mag_ratios`, calibrated per model and scheduler; nearest-
    interpolated to the step count), `threshold` on the accumulated error, at most `max_skip_steps` skipped
    in a row, and no skipping in the first `retention_ratio` of the steps."""

    ratios: Sequence[float]
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2

    def __post_init__(self) -> None:
        ratios = self.ratios
        if isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__len__") or len(ratios) == 0:
            raise UserError("MagCache ratios must be a non-empty list of numbers (from `python -m runtime calibrate`)")
        try:
            values = [float(r) for r in ratios]
        except (TypeError, ValueError):
            raise UserError("MagCache ratios must be numbers") from None
        if not all(math.isfinite(r) and r > 0 for r in values):
            raise UserError("MagCache ratios must be finite numbers > 0")
        object.__setattr__(self, "ratios", tuple(values))
        for name, value, ok in (("threshold", self.threshold, "a finite number >= 0"),
                                ("retention_ratio", self.retention_ratio, "a number in [0, 1]")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (name == "retention_ratio" and value > 1):
                raise UserError(f"MagCache {name} must be {ok}, got {value!r}")
        k = self.max_skip_steps
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise UserError(f"MagCache max_skip_steps must be an integer >= 0, got {k!r}")

    def to_json(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "max_skip_steps": int(self.max_skip_steps),
                "retention_ratio": self.retention_ratio, "ratios": list(self.ratios)}

    def interpolated(self, steps: int) -> np.ndarray:
        """The ratios at `steps` points, float32, as diffusers' `nearest_interp` (round half to even)."""
        src = np.asarray(self.ratios, np.float32)
        if len(src) == steps:
            return src
        if steps == 1:
            return src[-1:]
        scale = (len(src) - 1) / (steps - 1)
        idx = np.round(np.arange(steps, dtype=np.float32) * np.float32(scale)).astype(np.int64)
        return src[idx]

    def schedule(self, phases: Sequence[int]) -> list[bool]:
        """Whether each step runs the blocks (True) or reuses the residual (False); `phases[i]` is the expert
        of step i (all 0 for one expert)."""
        steps = len(phases)
        ratios = self.interpolated(steps)
        threshold = np.float32(self.threshold)
        length = {p: list(phases).count(p) for p in set(phases)}
        state: dict[int, dict[str, Any]] = {}  # per phase, as each expert's own hook state
        out = []
        for i, phase in enumerate(phases):
            st = state.setdefault(phase, {"step": 0, "ratio": np.float32(1.0), "err": np.float32(0.0), "run": 0,
                                          "residual": False})
            compute = True
            if st["step"] >= int(self.retention_ratio * length[phase] + 0.5):
                st["ratio"] = np.float32(st["ratio"] * ratios[i])
                st["run"] += 1
                st["err"] = np.float32(st["err"] + np.abs(np.float32(1.0) - st["ratio"]))
                if st["residual"] and st["err"] <= threshold and st["run"] <= self.max_skip_steps:
                    compute = False
                else:
                    st["ratio"], st["err"], st["run"] = np.float32(1.0), np.float32(0.0), 0
            st["residual"] = st["residual"] or compute
            st["step"] += 1
            out.append(compute)
        return out


def calibration_ratio(norms: np.ndarray, previous: np.ndarray | None) -> float:
    """diffusers' calibration ratio of one step: the mean over tokens of |residual| / (|previous| + 1e-8),
    from the per-token norms (float32) of the step's and the previous step's residual; 1.0 for a phase's
    first step. (WanPipeline calibrates cond and uncond in separate contexts; callers pass the cond half.)"""
    if previous is None:
        return 1.0
    return float(np.mean(norms.astype(np.float32) / (previous.astype(np.float32) + np.float32(1e-8))))


def load_ratios(path: str | Path) -> list[float]:
    """Ratios from a JSON file: a list of numbers, or an object with "mag_ratios" (what `calibrate` writes)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"MagCache ratios file {path} does not exist (make one with python -m runtime calibrate)") \
            from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read MagCache ratios from {path}: {e}") from None
    if isinstance(data, dict):
        data = data.get("mag_ratios")
    if not isinstance(data, list):
        raise UserError(f"{path} holds no MagCache ratios: expected a JSON list of numbers or an object with "
                        "\"mag_ratios\"")
    return data
