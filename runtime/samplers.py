"""The samplers a run may choose, each as coefficient rows over the one step program's state.

UniPC (runtime/scheduler.py), flow-matching Euler and DPM-Solver++ are all linear in the sample x_i and the
converted model outputs m_j = x_j - sigma_j v_j of the current and earlier steps, with coefficients that depend
only on the schedule. So every sampler is the same exported step program fed other rows (row layout in
runtime/scheduler.py): a sampler is a run-time choice, like the steps, the flow shift and the guidance, and needs
no program of its own. Euler and DPM-Solver++ have no corrector (the row's corrector part is the identity,
xc_i = x_i) and write their whole update into the predictor part.

    name    diffusers scheduler, as the Wan pipelines configure it          timesteps the DiT sees
    unipc   UniPCMultistepScheduler (flow_prediction, bh2, order 2)         int(sigma x 1000)
    euler   FlowMatchEulerDiscreteScheduler (shift)                         sigma x 1000, a float
    dpm++   DPMSolverMultistepScheduler (flow_prediction, use_flow_sigmas,  int(sigma x 1000)
            dpmsolver++, order 2, midpoint)
    flowmap FlowMapEulerDiscreteScheduler (shift; AnyFlow only)             sigma x 1000, a float, and r =
                                                                            the next sigma x 1000

flowmap is the flow map's step z_r = z_t - (sigma_t - sigma_r) u, u the DiT's mean velocity from t to r, on the
sigmas shift x s / (1 + (shift - 1) s) of s = linspace(1, 0, N + 1)[:-1] (float64, then 0): any step count runs the
same program. It is for models that take r (kinds.Kind.flow_map), and those take no other sampler but `euler`, which
on them is the same update with r = t (AnyFlowPipeline's use_mean_velocity=False). UniPC and DPM-Solver++ combine
past outputs as instantaneous velocities, which a mean velocity over a step is not.

Custom sigmas are one per step, before the flow shift, as `set_timesteps(sigmas=...)` takes them (lightx2v's
4-step `denoising_step_list` [1000, 750, 500, 250] is sigmas 1, 0.75, 0.5, 0.25); each sampler shifts them as its
diffusers scheduler does. diffusers' DPMSolverMultistepScheduler takes no custom sigmas; here dpm++ shifts them
as its flow sigmas are shifted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from . import scheduler
from .errors import UserError
from .scheduler import Plan, UniPCConfig

SAMPLERS = ("unipc", "euler", "dpm++", "flowmap")
# diffusers' scheduler class of each sampler: what a checkpoint's scheduler config names (export/source.py)
SCHEDULER_CLASSES = {"UniPCMultistepScheduler": "unipc", "FlowMatchEulerDiscreteScheduler": "euler",
                     "DPMSolverMultistepScheduler": "dpm++", "FlowMapEulerDiscreteScheduler": "flowmap"}
FLOW_MAP_SAMPLERS = ("flowmap", "euler")  # what a flow-map model (kinds.Kind.flow_map) runs
DPM_ORDER = 2  # dpm++ is DPM-Solver++(2M), what Wan's own repository and WanPipeline run

Sigmas = tuple[float, ...] | None


def samplers_for(flow_map: bool) -> tuple[str, ...]:
    """The samplers a bundle runs: a flow-map model's FLOW_MAP_SAMPLERS, any other's all but flowmap."""
    return FLOW_MAP_SAMPLERS if flow_map else tuple(s for s in SAMPLERS if s != "flowmap")


def mean_velocity_sampler(use_mean_velocity: object, sampler: str | None, flow_map: bool) -> str:
    """The sampler of AnyFlowPipeline's `use_mean_velocity` (True: flowmap, the DiT told r; False: euler, r = t) on a
    flow-map model; UserError for another model, a non-boolean, or a `sampler` that says otherwise."""
    if not flow_map:
        raise UserError("use_mean_velocity is for flow-map models (AnyFlow); this bundle's DiT takes no target "
                        "timestep")
    if not isinstance(use_mean_velocity, bool | np.bool_):
        raise UserError(f"use_mean_velocity must be true or false, got {use_mean_velocity!r}")
    chosen = "flowmap" if use_mean_velocity else "euler"
    if sampler is not None and sampler != chosen:
        raise UserError(f"use_mean_velocity={bool(use_mean_velocity)} is sampler {chosen}, but sampler {sampler} was "
                        "asked: give one of them")
    return chosen


def check_sampler(name: object, flow_map: bool | None = None) -> str:
    """`name` if it is a sampler a bundle whose DiT is (`flow_map`) or is not a flow-map model runs (None: any
    bundle's name); UserError else."""
    if not isinstance(name, str) or name not in SAMPLERS:
        raise UserError(f"sampler {name!r} is not one of {', '.join(SAMPLERS)}")
    if flow_map and name not in FLOW_MAP_SAMPLERS:
        raise UserError(f"sampler {name} treats past outputs as instantaneous velocities, and this flow-map model "
                        "predicts mean velocities over a step: use sampler flowmap (or euler: the same update with "
                        "r = t)")
    if flow_map is False and name == "flowmap":
        raise UserError("sampler flowmap is for flow-map models (AnyFlow), whose DiT takes the step's target "
                        f"timestep: this bundle's runs {', '.join(s for s in SAMPLERS if s != 'flowmap')}")
    return name


def check_sigmas(sigmas: object, steps: int | None = None) -> tuple[float, ...]:
    """Custom sigmas as a tuple of floats: strictly decreasing in (0, 1], one per step (`steps`, when given)."""
    if isinstance(sigmas, str) or not isinstance(sigmas, Sequence | np.ndarray):
        raise UserError(f"sigmas must be a list of numbers (one per step, e.g. 1,0.75,0.5,0.25), got {sigmas!r}")
    values = []
    for s in sigmas:
        if isinstance(s, bool) or not isinstance(s, int | float | np.floating | np.integer) or not math.isfinite(s):
            raise UserError(f"sigmas must be numbers, got {s!r}")
        values.append(float(s))
    if not values:
        raise UserError("sigmas is empty: give one per step (e.g. 1,0.75,0.5,0.25)")
    if not all(0 < s <= 1 for s in values) or any(b >= a for a, b in zip(values, values[1:])):
        raise UserError(f"sigmas must be strictly decreasing and in (0, 1] (noise levels before the flow shift, "
                        f"one per step), got {', '.join(f'{s:g}' for s in values)}")
    if steps is not None and len(values) != steps:
        raise UserError(f"{len(values)} sigmas for {steps} steps: give one sigma per step (or leave steps out)")
    return tuple(values)


def parse_sigmas(text: str | None) -> tuple[float, ...] | None:
    """'1,0.75,0.5,0.25' (a command line's --sigmas) -> the checked sigmas; None for None."""
    if text is None:
        return None
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        raise UserError(f"sigmas {text!r} is not a comma-separated list of numbers (e.g. 1,0.75,0.5,0.25)") from None
    return check_sigmas(values)


def plan(sampler: str, steps: int, shift: float, config: UniPCConfig, sigmas: Sigmas = None, start: int = 0) -> Plan:
    """Timesteps, sigmas and one coefficient row per step of `sampler` (rows in the layout of `config`'s state
    order). With `start`, the steps from `start` on, the solver's history beginning there (video-to-video's
    `strength`; `start_step`). Memoized, read-only arrays; ValueError for a bad argument (settings.resolve checks
    them first)."""
    sigmas = None if sigmas is None else tuple(float(s) for s in sigmas)
    return _plan(sampler, steps, float(shift), config, sigmas, start)


def start_step(steps: int, strength: float) -> int:
    """The first of `steps` steps a video-to-video run at `strength` takes (diffusers' get_timesteps):
    steps - min(int(steps x strength), steps), but at least the last step runs: where int(steps x strength) is 0,
    diffusers' pipeline is left with no timestep and fails, so every strength in (0, 1] and step count is a run."""
    return steps - max(1, min(int(steps * strength), steps))


@functools.lru_cache(maxsize=32)
def _plan(sampler: str, steps: int, shift: float, config: UniPCConfig, sigmas: Sigmas, start: int) -> Plan:
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}")
    if steps < 1 or (sigmas is not None and len(sigmas) != steps) or not 0 <= start < steps:
        raise ValueError("steps must be >= 1, one sigma per step, and the start a step")
    if not shift > 0:
        raise ValueError("flow shift must be > 0")
    if sampler == "unipc":
        return scheduler.plan(steps, shift, config, sigmas, start)
    if sampler == "flowmap":
        timesteps, sig = flowmap_sigmas(steps, shift, config.num_train_timesteps, sigmas)
        rows = flowmap_rows(sig, config.solver_order)
    elif sampler == "euler":
        timesteps, sig = euler_sigmas(steps, shift, config.num_train_timesteps, sigmas)
        rows = euler_rows(sig.astype(np.float64), config.solver_order)
    else:
        timesteps, sig = dpm_sigmas(steps, shift, config.num_train_timesteps, sigmas)
        rows = dpm_rows(sig, config.solver_order, start)
    return _frozen(Plan(timesteps=timesteps[start:].astype(np.float32), sigmas=sig[start:].astype(np.float32),
                        coeffs=rows[start:].astype(np.float32)))


def euler_rows(sig: np.ndarray, order: int) -> np.ndarray:
    """Flow-matching Euler's rows on the sigmas `sig` (N + 1, ending in 0): x_{i+1} = x_i + (s_{i+1} - s_i) v_i =
    (s_{i+1}/s_i) x_i + (1 - s_{i+1}/s_i) m_i, no corrector."""
    rows = np.zeros((len(sig) - 1, scheduler.row_size(order)), np.float64)
    for i, row in enumerate(rows):
        _identity_corrector(row, order)
        ratio = sig[i + 1] / sig[i]
        _predictor(row, order)[:2] = (ratio, 1.0 - ratio)
        row[0] = sig[i]
    return rows


def flowmap_sigmas(steps: int, shift: float, num_train_timesteps: int, sigmas: Sigmas
                   ) -> tuple[np.ndarray, np.ndarray]:
    """FlowMapEulerDiscreteScheduler(shift=shift).set_timesteps(steps[, sigmas=...]): float64 sigmas shifted from
    linspace(1, 0, steps + 1)[:-1] (or the custom ones), then 0; timesteps sigma x 1000 as the DiT sees them
    (float32)."""
    s = np.linspace(1.0, 0.0, steps + 1, dtype=np.float64)[:-1] if sigmas is None else np.asarray(sigmas, np.float64)
    if shift != 1.0:
        s = shift * s / (1 + (shift - 1) * s)
    full = np.concatenate([s, [0.0]])
    return (full[:-1] * num_train_timesteps).astype(np.float32), full


def flowmap_rows(sig: np.ndarray, order: int) -> np.ndarray:
    """The flow map's rows on the float64 sigmas `sig` (N + 1, ending in 0): x_r = x_t - (sigma_t - sigma_r) u, as
    FlowMapEulerDiscreteScheduler.step computes it (m = x - c0 u with c0 = sigma_t - sigma_r, taken whole), no
    corrector."""
    rows = np.zeros((len(sig) - 1, scheduler.row_size(order)), np.float64)
    for i, row in enumerate(rows):
        _identity_corrector(row, order)
        _predictor(row, order)[:2] = (0.0, 1.0)
        row[0] = sig[i] - sig[i + 1]
    return rows


def euler_sigmas(steps: int, shift: float, num_train_timesteps: int, sigmas: Sigmas) -> tuple[np.ndarray, np.ndarray]:
    """FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(steps[, sigmas=...]): float timesteps
    (sigma x 1000, float32) and float32 sigmas ending in 0. Without sigmas, timesteps are spaced evenly from
    1000 to the scheduler's own smallest shifted training sigma x 1000 (computed in float32, as torch does)."""
    n = num_train_timesteps
    if sigmas is None:
        f32 = np.float32
        train = np.linspace(1, n, n, dtype=np.float32)[::-1] / f32(n)  # the scheduler's __init__, in float32
        shifted = f32(shift) * train / (f32(1) + f32(shift - 1) * train)
        sigma_max, sigma_min = float(shifted[0]), float(shifted[-1])
        s = np.linspace(sigma_max * n, sigma_min * n, steps) / n
    else:
        s = np.asarray(sigmas, np.float32)
    s = (shift * s / (1 + (shift - 1) * s)).astype(np.float32)
    timesteps = s * np.float32(n)
    return timesteps, np.concatenate([s, [0.0]]).astype(np.float32)


def dpm_sigmas(steps: int, shift: float, num_train_timesteps: int, sigmas: Sigmas) -> tuple[np.ndarray, np.ndarray]:
    """DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=shift).set_timesteps(steps): int timesteps
    (truncated sigma x 1000) and float32 sigmas ending in 0 (final_sigmas_type "zero"). Its flow sigmas are
    1 - linspace(1, 1/1000, steps + 1), shifted, reversed, the last (0) dropped: they start below 1."""
    n = num_train_timesteps
    if sigmas is None:
        s = 1.0 - np.linspace(1, 1 / n, steps + 1)
        s = np.flip(shift * s / (1 + (shift - 1) * s))[:-1].copy()
    else:
        s = np.asarray(sigmas, np.float64)
        s = shift * s / (1 + (shift - 1) * s)
    timesteps = (s * n).astype(np.int64)
    return timesteps, np.concatenate([s, [0.0]]).astype(np.float32)


def dpm_rows(sigmas32: np.ndarray, order: int, start: int = 0) -> np.ndarray:
    """DPM-Solver++ (flow, data prediction, midpoint) rows: first order on the first step run (`start`) and on the
    last (final sigma zero), second order (multistep, from m_i and m_{i-1}) between; computed from the float32 sigmas
    as diffusers computes them."""
    if order < 2:
        raise UserError("this bundle's step programs keep no earlier model output (its UniPC solver_order is 1), "
                        "which dpm++ (second order) needs: use sampler unipc or euler")
    s = sigmas32.astype(np.float64)
    steps = len(s) - 1
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lam = np.log(1.0 - s) - np.log(s)  # +inf at sigma 0, -inf at sigma 1
        rows = np.zeros((steps, scheduler.row_size(order)), np.float64)
        for i, row in enumerate(rows):
            row[0] = s[i]
            _identity_corrector(row, order)
            p = _predictor(row, order)
            alpha_t = 1.0 - s[i + 1]
            h = lam[i + 1] - lam[i]
            e = np.expm1(-h)  # exp(-h) - 1
            p[0] = s[i + 1] / s[i]  # sigma_t / sigma_s0
            p[1] = -alpha_t * e  # D0 = m_i
            if start < i < steps - 1 and DPM_ORDER == 2:
                r0 = (lam[i] - lam[i - 1]) / h
                if math.isfinite(r0) and r0 != 0:  # an infinite h_0 (a first sigma of 1) makes D1 vanish
                    d1 = -0.5 * alpha_t * e / r0  # D1 = (m_i - m_{i-1}) / r0
                    p[1] += d1
                    p[2] -= d1
    return rows


def _identity_corrector(row: np.ndarray, order: int) -> None:
    row[1:1 + order + 3] = 0.0
    row[1] = 1.0  # xc_i = x_i


def _predictor(row: np.ndarray, order: int) -> np.ndarray:
    return row[1 + order + 3:]


def _frozen(p: Plan) -> Plan:
    for a in (p.timesteps, p.sigmas, p.coeffs):
        a.setflags(write=False)
    return p


def check_plan(sampler: str, steps: int, shift: float, config: UniPCConfig, sigmas: Sigmas, default_shift: float
               ) -> None:
    """Refuse a schedule that is unusable (noise levels that round to 0 or 1, NaN coefficients) before anything
    runs, naming the flow shift rather than failing later in the weights."""
    with np.errstate(all="ignore"):
        try:
            p = plan(sampler, steps, shift, config, sigmas)
        except (ValueError, ZeroDivisionError, FloatingPointError):
            p = None
        levels = p.sigmas[:-1] if p is not None else np.array([np.nan])
        inside = (levels > 0) & (levels < 1)
        # A schedule may start at pure noise (euler, custom sigmas), or a float32 rounding above it: diffusers'
        # FlowMatchEulerDiscreteScheduler at flow shift 0.01 starts at 1.0000954.
        inside[0] = 0 < levels[0] <= 1.001
        ok = p is not None and bool(np.all(inside)) and bool(np.all(np.diff(p.sigmas) <= 0)) \
            and bool(np.isfinite(p.coeffs).all())
    if not ok:
        shown = f"{levels[0]:.3g} .. {levels[-1]:.3g}"
        raise UserError(f"flow shift {shift:g} gives an unusable {steps}-step {sampler} schedule (noise levels {shown} "
                        f"must lie strictly between 0 and 1 and decrease): use a flow shift of about 1 to 20 (this "
                        f"bundle's default is {default_shift:g})")


# Settings of each diffusers scheduler that the rows here do not model, with the values they must have.
_EULER_FIXED = {"use_dynamic_shifting": (False,), "invert_sigmas": (False,), "shift_terminal": (None, 0, 0.0),
                "use_karras_sigmas": (False,), "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,),
                "stochastic_sampling": (False,)}
_DPM_FIXED = {"prediction_type": ("flow_prediction",), "use_flow_sigmas": (True,), "algorithm_type": ("dpmsolver++",),
              "solver_order": (DPM_ORDER,), "solver_type": ("midpoint",), "final_sigmas_type": ("zero",),
              "thresholding": (False,), "use_dynamic_shifting": (False,), "use_karras_sigmas": (False,),
              "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,), "use_lu_lambdas": (False,),
              "variance_type": (None,)}


def from_checkpoint(cfg: dict) -> tuple[str, UniPCConfig, float]:
    """(sampler, UniPC config of the bundle's step state, default flow shift) of a diffusers scheduler config;
    ValueError saying why if its scheduler is not one these rows reproduce. A checkpoint whose scheduler is not
    UniPC gets Wan's UniPC configuration (order 2, so dpm++ fits its state too) for `--sampler unipc`."""
    name = cfg.get("_class_name", "UniPCMultistepScheduler")
    if name in ("HeliosScheduler", "HeliosDMDScheduler"):
        return helios_scheduler(cfg)
    sampler = SCHEDULER_CLASSES.get(name)
    if sampler is None:
        raise ValueError(f"scheduler {name} is not supported (only {', '.join(SCHEDULER_CLASSES)})")
    if sampler == "unipc":
        unipc = scheduler.config_from_diffusers(cfg)
        return sampler, unipc, unipc.flow_shift
    if sampler == "flowmap":  # no history: a state of order 1 (x, the corrected x, m)
        shift = float(cfg.get("shift") if cfg.get("shift") is not None else 1.0)
        return sampler, UniPCConfig(num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)), solver_order=1,
                                    flow_shift=shift), shift
    fixed, shift_key = (_EULER_FIXED, "shift") if sampler == "euler" else (_DPM_FIXED, "flow_shift")
    for key, allowed in fixed.items():
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"{name} setting {key}={cfg[key]!r} is not supported (expected one of {allowed})")
    shift = float(cfg.get(shift_key) if cfg.get(shift_key) is not None else 1.0)
    return sampler, UniPCConfig(num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)), flow_shift=shift), shift


# HeliosScheduler's settings that the rows here do not model, with the values they must have.
_HELIOS_FIXED = {"prediction_type": ("flow_prediction",), "use_flow_sigmas": (True,), "predict_x0": (True,),
                 "thresholding": (False,), "solver_p": (None,), "solver_type": ("bh1", "bh2"),
                 "scheduler_type": ("unipc", "euler"), "time_shift_type": ("exponential", "linear")}


def helios_scheduler(cfg: dict) -> tuple[str, UniPCConfig, float]:
    """from_checkpoint for diffusers' HeliosScheduler, as HeliosPipeline runs it (its single-stage schedule,
    runtime/helios.py): UniPC (bh2, order 2) or Euler by its scheduler_type, on sigmas the run computes. A
    HeliosDMDScheduler (the distilled pyramid's, runtime/helios.py's "dmd" rows) keeps the order-2 state, whose
    second row carries the stage's start."""
    if cfg.get("_class_name") == "HeliosDMDScheduler":
        cfg = {k: v for k, v in cfg.items() if k in ("num_train_timesteps", "shift", "prediction_type",
                                                     "use_flow_sigmas")}
    for key, allowed in _HELIOS_FIXED.items():
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"HeliosScheduler setting {key}={cfg[key]!r} is not supported (expected one of {allowed})")
    order = int(cfg.get("solver_order", 2))
    if order not in (1, 2, 3):
        raise ValueError(f"HeliosScheduler solver_order={order} is not supported (1, 2 or 3)")
    shift = float(cfg.get("shift") if cfg.get("shift") is not None else 1.0)
    unipc = UniPCConfig(num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)), solver_order=order,
                        solver_type=str(cfg.get("solver_type", "bh2")),
                        lower_order_final=bool(cfg.get("lower_order_final", True)),
                        disable_corrector=tuple(int(i) for i in cfg.get("disable_corrector", ()) or ()),
                        flow_shift=shift)
    return str(cfg.get("scheduler_type", "unipc")), unipc, shift
