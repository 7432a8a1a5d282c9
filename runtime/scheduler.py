"""UniPC (flow prediction, multistep, predictor-corrector) as per-step coefficient rows.

diffusers' ``UniPCMultistepScheduler`` as Wan configures it is linear in the
current sample, the previous corrected sample and the last few converted model
outputs ``m_j = x_j - sigma_j * v_j``; every coefficient depends only on the
number of steps, the flow shift and the step index. We compute those
coefficients here in float64 numpy and feed one row per step into the exported
denoise program, so steps, flow shift and guidance are runtime choices and no
linear solve (a bf16 trouble spot in TPU ports) ever runs on the device.

Denoise state layout, ``K`` = solver order::

    state[0]      x_i          sample the model sees at step i (predictor output)
    state[1]      xc_{i-1}     previous corrected sample (the corrector's base)
    state[2+j]    m_{i-1-j}    converted model outputs of earlier steps, j < K

Row layout (``row_size(K)`` floats)::

    [sigma_i,
     c_x, c_xprev, c_m_i, c_m_{i-1} .. c_m_{i-K},      corrector -> xc_i
     p_xc, p_m_i, p_m_{i-1} .. p_m_{i-K+1}]            predictor -> x_{i+1}
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SUPPORTED_CLASS = "UniPCMultistepScheduler"



TIMESTEP_SCALE = 1000.0  # the timesteps the schedules give (sigma x num_train_timesteps), as released Wan is fed


def scaled_timesteps(t: Any, scale: float) -> Any:
    """Schedule timesteps (sigma x 1000) as a DiT trained on sigma x `scale` takes them (manifest.Defaults
    .timestep_scale): computed in float64 and rounded once to float32; a scalar stays a numpy scalar."""
    return (np.asarray(t, np.float64) * (scale / TIMESTEP_SCALE)).astype(np.float32)[()]


@dataclass(frozen=True)
class UniPCConfig:
    """The subset of diffusers' scheduler config that the coefficient tables depend on."""

    num_train_timesteps: int = 1000
    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    final_sigmas_type: str = "zero"
    disable_corrector: tuple[int, ...] = field(default_factory=tuple)
    flow_shift: float = 3.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["disable_corrector"] = list(self.disable_corrector)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> UniPCConfig:
        d = dict(d)
        d["disable_corrector"] = tuple(d.get("disable_corrector", ()))
        return cls(**d)


def unsupported_reason(cfg: dict[str, Any]) -> str | None:
    """Why a diffusers scheduler config can't be expressed as coefficient rows (None if it can)."""
    if cfg.get("_class_name", SUPPORTED_CLASS) != SUPPORTED_CLASS:
        return f"scheduler {cfg.get('_class_name')} is not supported (only {SUPPORTED_CLASS})"
    checks = {
        "prediction_type": ("flow_prediction",), "use_flow_sigmas": (True,), "predict_x0": (True,),
        "thresholding": (False,), "use_dynamic_shifting": (False,), "use_karras_sigmas": (False,),
        "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,), "solver_p": (None,),
        "solver_type": ("bh1", "bh2"), "final_sigmas_type": ("zero", "sigma_min"), "shift_terminal": (None,),
    }
    for key, allowed in checks.items():
        if key in cfg and cfg[key] not in allowed:
            return f"scheduler setting {key}={cfg[key]!r} is not supported (expected one of {allowed})"
    if cfg.get("solver_order", 2) not in (1, 2, 3):
        return f"solver_order={cfg.get('solver_order')} is not supported (1, 2 or 3)"
    return None


def config_from_diffusers(cfg: dict[str, Any]) -> UniPCConfig:
    reason = unsupported_reason(cfg)
    if reason:
        raise ValueError(reason)
    return UniPCConfig(
        num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)),
        solver_order=int(cfg.get("solver_order", 2)),
        solver_type=str(cfg.get("solver_type", "bh2")),
        lower_order_final=bool(cfg.get("lower_order_final", True)),
        final_sigmas_type=str(cfg.get("final_sigmas_type", "zero")),
        disable_corrector=tuple(int(i) for i in cfg.get("disable_corrector", ()) or ()),
        flow_shift=float(cfg.get("flow_shift", 1.0) if cfg.get("flow_shift") is not None else 1.0),
    )


def row_size(order: int) -> int:
    return 1 + (order + 3) + (order + 1)


def state_rows(order: int) -> int:
    return order + 2


@dataclass(frozen=True)
class Plan:
    """Everything the denoise loop needs: the timesteps and one coefficient row per step."""

    timesteps: np.ndarray  # (N,) float32, what the transformer sees (whole numbers for UniPC)
    sigmas: np.ndarray  # (N + 1,) float32, as diffusers stores them
    coeffs: np.ndarray  # (N, row_size) float32


def sigmas_for(steps: int, shift: float, cfg: UniPCConfig, sigmas: tuple[float, ...] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' flow-sigma schedule: (timesteps int64, sigmas float32 with the final sigma). `sigmas`: custom
    ones, one per step, before the shift (set_timesteps(sigmas=...))."""
    n = cfg.num_train_timesteps
    s = np.linspace(1, 1 / n, steps + 1)[:-1] if sigmas is None else np.array(sigmas, np.float64)
    s = shift * s / (1 + (shift - 1) * s)
    if abs(s[0] - 1) < 1e-6:
        s[0] -= 1e-6
    timesteps = (s * n).copy().astype(np.int64)
    last = 0.0 if cfg.final_sigmas_type == "zero" else s[-1]
    return timesteps, np.concatenate([s, [last]]).astype(np.float32)


def _bh_terms(h: float, order: int, solver_type: str, rks: list[float]) -> tuple[float, float, np.ndarray, np.ndarray]:
    """h_phi_1, B_h, R and b of diffusers' UniPC bh update (predict_x0 form).

    IEEE semantics as in torch: with a zero final sigma h is +inf (h_phi_1 = -1), and with
    a repeated final sigma h is 0; the terms that come out inf/nan are then never used.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        hh = np.float64(-h)
        h_phi_1 = np.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        b_h = hh if solver_type == "bh1" else h_phi_1
        r_rows, b = [], []
        factorial = 1
        rk_arr = np.array(rks + [1.0], dtype=np.float64)
        for i in range(1, order + 1):
            r_rows.append(rk_arr ** (i - 1))
            b.append(h_phi_k * factorial / b_h)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
    return float(h_phi_1), float(b_h), np.array(r_rows), np.array(b)


@functools.lru_cache(maxsize=16)
def plan(steps: int, shift: float, cfg: UniPCConfig, sigmas: tuple[float, ...] | None = None, start: int = 0) -> Plan:
    """Coefficient rows for `steps` denoising steps at flow shift `shift` (custom `sigmas`: one per step, before the
    shift), memoized: settings checks and the loop ask for the same plan; its arrays are read-only. With `start`, the
    steps from `start` on of that schedule, the solver's history beginning there (as diffusers' scheduler runs the
    timesteps a video-to-video `strength` leaves: its first step has no corrector and order 1)."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    if not shift > 0:
        raise ValueError("flow shift must be > 0")
    timesteps, sigmas32 = sigmas_for(steps, shift, cfg, sigmas)
    # diffusers computes from the float32 sigmas
    return plan_of(timesteps, sigmas32, sigmas32.astype(np.float64), cfg, start)


def plan_of(timesteps: np.ndarray, sigmas: np.ndarray, sig: np.ndarray, cfg: UniPCConfig, start: int = 0,
            floor: float = 0.0) -> Plan:
    """The Plan of a given schedule: `timesteps` (N,) as the DiT sees them, `sigmas` (N + 1,) as stored, `sig` the
    float64 sigmas the coefficients are computed from. `floor`: the sigma below which a scheduler clamps its sigma_t
    (HeliosScheduler's 1e-8; 0: none, a final 0 gives lambda = inf, as torch)."""
    steps = len(timesteps)
    K = cfg.solver_order
    st = np.maximum(sig, floor) if floor else sig  # sigma_t as the scheduler takes it (alpha_t = 1 - sigma unclamped)
    lam = [float(np.log(1.0 - a) - np.log(b)) if b > 0 else math.inf for a, b in zip(sig, st)]
    rows = np.zeros((steps, row_size(K)), dtype=np.float64)
    orders = [min(K, steps - i if cfg.lower_order_final else K, i - start + 1) for i in range(steps)]
    for i in range(start, steps):
        row = rows[i]
        row[0] = sig[i]
        c = row[1:1 + K + 3]  # x_i, xprev, m_i, m_{i-1}..m_{i-K}
        p = row[1 + K + 3:]  # xc, m_i, m_{i-1}..m_{i-K+1}
        # Corrector: refines x_i using m_i, based on xc_{i-1} and the order of step i-1.
        if i > start and (i - 1) not in cfg.disable_corrector:
            order = orders[i - 1]
            h = lam[i] - lam[i - 1]
            rks = [(lam[i - 1 - k] - lam[i - 1]) / h for k in range(1, order)]
            h_phi_1, b_h, R, b = _bh_terms(h, order, cfg.solver_type, rks)
            rhos = np.array([0.5]) if order == 1 else np.linalg.solve(R, b)
            alpha_t = 1.0 - sig[i]
            c[1] = st[i] / st[i - 1]
            c[3] += -alpha_t * h_phi_1  # m_{i-1} is m0 of the corrector
            for k, rk in enumerate(rks, start=1):  # D1_k = (m_{i-1-k} - m_{i-1}) / rk
                w = -alpha_t * b_h * rhos[k - 1] / rk
                c[3 + k] += w
                c[3] -= w
            c[2] += -alpha_t * b_h * rhos[-1]  # D1_t = m_i - m_{i-1}
            c[3] += alpha_t * b_h * rhos[-1]
        else:
            c[0] = 1.0
        # Predictor: x_{i+1} from xc_i and m_i, m_{i-1}, ...
        order = orders[i]
        h = lam[i + 1] - lam[i]
        rks = [(lam[i - k] - lam[i]) / h for k in range(1, order)]
        h_phi_1, b_h, R, b = _bh_terms(h, order, cfg.solver_type, rks)
        alpha_t = 1.0 - sig[i + 1]
        p[0] = st[i + 1] / st[i]
        p[1] = -alpha_t * h_phi_1
        if order > 1:
            rhos_p = np.array([0.5]) if order == 2 else np.linalg.solve(R[:-1, :-1], b[:-1])
            for k, rk in enumerate(rks, start=1):
                w = -alpha_t * b_h * rhos_p[k - 1] / rk
                p[1 + k] += w
                p[1] -= w
    out = Plan(timesteps=np.asarray(timesteps)[start:].astype(np.float32),
               sigmas=np.asarray(sigmas, np.float32)[start:], coeffs=rows[start:].astype(np.float32))
    for a in (out.timesteps, out.sigmas, out.coeffs):
        a.setflags(write=False)
    return out


def apply_row(state: np.ndarray, v: np.ndarray, row: np.ndarray, order: int) -> np.ndarray:
    """One scheduler update in numpy (the math the exported step program bakes in)."""
    K = order
    x, xprev, hist = state[0], state[1], state[2:]
    m_i = x - row[0] * v
    c = row[1:1 + K + 3]
    p = row[1 + K + 3:]
    xc = c[0] * x + c[1] * xprev + c[2] * m_i + sum(c[3 + j] * hist[j] for j in range(K))
    x_next = p[0] * xc + p[1] * m_i + sum(p[2 + j] * hist[j] for j in range(K - 1))
    return np.stack([x_next, xc, m_i, *hist[:K - 1]])
