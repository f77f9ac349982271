"""The in-kernel gate: gradients of A_log, dt_bias and the raw g against autograd
of the formula −exp(A_log)·softplus(g + dt_bias) feeding the fp32 oracle."""

from __future__ import annotations

import pytest
import torch

from gdn_core.testkit import assert_close, make_inputs, reference_gdn, run_fwd_bwd


def test_gate_gradients_against_formula(api):
    inputs, cu, cot = make_inputs([20, 64, 100], H=1, HV=2, seed=40, gate=True)
    got = run_fwd_bwd(api.autograd, inputs, cu, cot)
    ref = run_fwd_bwd(reference_gdn, inputs, cu, cot)
    assert_close(got, ref, rtol=2e-5)


def test_gate_large_arguments_use_softplus_threshold(api):
    # g + dt_bias > 20: softplus is the identity there, its derivative 1
    inputs, cu, cot = make_inputs([40], H=1, HV=2, seed=41, gate=True)
    inputs["g"] = inputs["g"] + torch.tensor([25.0, 0.0])
    inputs["A_log"] = torch.tensor([-5.0, 0.0])
    got = run_fwd_bwd(api.autograd, inputs, cu, cot)
    ref = run_fwd_bwd(reference_gdn, inputs, cu, cot)
    assert_close(got, ref, rtol=1e-4)


def test_split_api_returns_gate_gradients(api):
    inputs, cu, cot = make_inputs([50], seed=42, gate=True)
    _, _, saved = api.fwd(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], cu_seqlens=cu,
        use_gate_in_kernel=True, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
        initial_state=inputs["initial_state"],
    )
    grads = api.bwd(saved, cot["do"])
    assert grads.dA_log.shape == (2,) and grads.ddt_bias.shape == (2,)
    assert grads.dg.shape == inputs["g"].shape


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(A_log=None), ValueError, "use_gate_in_kernel=True needs A_log"),
        (dict(dt_bias=torch.zeros(3)), ValueError, r"dt_bias must have shape \(2,\)"),
        (dict(A_log=[0.0, 0.0]), TypeError, "A_log must be a torch.Tensor"),
        (dict(use_gate_in_kernel=False), ValueError, "used only with use_gate_in_kernel=True"),
    ],
)
def test_gate_bad_parameters(api, kwargs, exc, pattern):
    inputs, cu, _ = make_inputs([10], seed=43, gate=True)
    args = dict(use_gate_in_kernel=True, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"])
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        api.autograd(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                                   inputs["beta"], cu_seqlens=cu, **args)
