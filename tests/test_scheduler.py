"""The numpy UniPC coefficient rows against diffusers' UniPCMultistepScheduler."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import scheduler as S


def _fake_model(x: np.ndarray, i: int) -> np.ndarray:
    return np.tanh(0.7 * x + 0.1 * i).astype(np.float32)


@pytest.mark.parametrize("order", [2, 1, 3])
@pytest.mark.parametrize("steps", [1, 2, 3, 10, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 12.0])
def test_trajectory_matches_diffusers(order: int, steps: int, shift: float) -> None:
    import torch
    from diffusers import UniPCMultistepScheduler

    ref = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                  solver_order=order, solver_type="bh2", lower_order_final=True)
    ref.set_timesteps(steps)
    plan = S.plan(steps, shift, S.config_from_diffusers(dict(ref.config)))
    np.testing.assert_array_equal(plan.timesteps, ref.timesteps.numpy())
    np.testing.assert_array_equal(plan.sigmas, ref.sigmas.numpy())

    x0 = np.random.default_rng(steps).standard_normal((1, 4, 2, 3, 3)).astype(np.float32)
    x_ref = torch.from_numpy(x0.copy())
    state = np.zeros((S.state_rows(order), *x0.shape), np.float32)
    state[0] = x0
    for i, t in enumerate(ref.timesteps):
        x_ref = ref.step(torch.from_numpy(_fake_model(x_ref.numpy(), i)), t, x_ref, return_dict=False)[0]
        state = S.apply_row(state, _fake_model(state[0], i), plan.coeffs[i], order)
        assert np.abs(state[0] - x_ref.numpy()).max() <= 1e-5, f"step {i}"


def test_disable_corrector_bh1_sigma_min() -> None:
    # (bh1 with a zero final sigma is NaN in diffusers itself, so that pairing is not compared.)
    import torch
    from diffusers import UniPCMultistepScheduler

    ref = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
                                  solver_type="bh1", disable_corrector=[0, 3], final_sigmas_type="sigma_min")
    ref.set_timesteps(8)
    plan = S.plan(8, 5.0, S.config_from_diffusers(dict(ref.config)))
    x_ref = torch.ones(1, 2, 1, 2, 2)
    state = np.zeros((4, 1, 2, 1, 2, 2), np.float32)
    state[0] = 1.0
    for i, t in enumerate(ref.timesteps):
        x_ref = ref.step(torch.from_numpy(_fake_model(x_ref.numpy(), i)), t, x_ref, return_dict=False)[0]
        state = S.apply_row(state, _fake_model(state[0], i), plan.coeffs[i], 2)
    assert np.isfinite(x_ref.numpy()).all()
    assert np.abs(state[0] - x_ref.numpy()).max() <= 1e-5


def test_unsupported_configs_are_named() -> None:
    assert "prediction_type" in S.unsupported_reason({"prediction_type": "epsilon"})
    assert "FlowMatchEulerDiscreteScheduler" in S.unsupported_reason({"_class_name": "FlowMatchEulerDiscreteScheduler"})
    assert S.unsupported_reason({"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
                                 "use_flow_sigmas": True}) is None


def test_bad_plan_arguments() -> None:
    with pytest.raises(ValueError, match="steps"):
        S.plan(0, 3.0, S.UniPCConfig())
    with pytest.raises(ValueError, match="shift"):
        S.plan(5, 0.0, S.UniPCConfig())
