"""gdn_core.gate: g = −exp(A_log)·softplus(g_raw + dt_bias), its explicit
backward against autograd of the formula, and the fixed-order token sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gdn_core.gate import (
    TOKEN_BLOCK,
    GateFunction,
    gate_bwd,
    gate_fwd,
    gdn_gate,
    ordered_token_sum,
    sum_partials_in_order,
    token_block_partials,
)


def _rand(*shape, seed=0, dtype=torch.float64, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


def formula(g_raw, A_log, dt_bias):
    return -A_log.exp() * F.softplus(g_raw + dt_bias)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("T", [7, TOKEN_BLOCK * 2 + 5])
def test_backward_against_autograd_of_formula(deterministic, T):
    HV = 3
    g_raw, A_log, dt_bias = _rand(2, T, HV, seed=1, scale=3), _rand(HV, seed=2), _rand(HV, seed=3)
    dg = _rand(2, T, HV, seed=4)
    leaves = [t.clone().requires_grad_() for t in (g_raw, A_log, dt_bias)]
    y = formula(*leaves)
    y.backward(dg)
    torch.testing.assert_close(gate_fwd(g_raw, A_log, dt_bias), y.detach())
    got = gate_bwd(g_raw, A_log, dt_bias, dg, deterministic=deterministic)
    for a, leaf in zip(got, leaves):
        torch.testing.assert_close(a, leaf.grad, rtol=1e-10, atol=1e-10)


def test_softplus_threshold_region():
    g_raw = torch.tensor([[-30.0, 0.0, 19.9, 20.1, 40.0]], dtype=torch.float64).T
    A_log, dt_bias = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (g_raw, A_log, dt_bias)]
    formula(*leaves).sum().backward()
    got = gate_bwd(g_raw, A_log, dt_bias, torch.ones_like(g_raw), deterministic=True)
    for a, leaf in zip(got, leaves):
        torch.testing.assert_close(a, leaf.grad)


def test_dtypes():
    g_raw = _rand(1, 10, 2, seed=5, dtype=torch.float32).to(torch.bfloat16)
    A_log, dt_bias = _rand(2, seed=6, dtype=torch.float32), _rand(2, seed=7, dtype=torch.float32)
    g = gate_fwd(g_raw, A_log, dt_bias)
    assert g.dtype == torch.float32  # the decay stays fp32
    dg_raw, dA, ddt = gate_bwd(g_raw, A_log, dt_bias, torch.ones_like(g), deterministic=True)
    assert dg_raw.dtype == torch.bfloat16 and dA.dtype == ddt.dtype == torch.float32


def test_gradcheck_and_function():
    leaves = [t.requires_grad_() for t in (_rand(1, 9, 2, seed=8), _rand(2, seed=9),
                                          _rand(2, seed=10))]
    assert torch.autograd.gradcheck(lambda *a: GateFunction.apply(*a, True), leaves)
    assert torch.autograd.gradcheck(lambda *a: gdn_gate(*a, deterministic=False), leaves)


def test_deterministic_bitwise():
    T = TOKEN_BLOCK * 3 + 17
    g_raw = _rand(1, T, 4, seed=11, dtype=torch.float32)
    A_log, dt_bias = _rand(4, seed=12, dtype=torch.float32), _rand(4, seed=13, dtype=torch.float32)
    dg = _rand(1, T, 4, seed=14, dtype=torch.float32)
    first = gate_bwd(g_raw, A_log, dt_bias, dg, deterministic=True)
    for _ in range(3):
        again = gate_bwd(g_raw, A_log, dt_bias, dg, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_ordered_sums():
    x = _rand(TOKEN_BLOCK * 2 + 3, 5, seed=15)
    parts = token_block_partials(x)
    assert parts.shape == (3, 5)
    torch.testing.assert_close(parts[2], x[2 * TOKEN_BLOCK:].sum(0))
    manual = (parts[0] + parts[1]) + parts[2]
    assert torch.equal(sum_partials_in_order(parts), manual)
    torch.testing.assert_close(ordered_token_sum(x, True), x.sum(0))
    assert torch.equal(ordered_token_sum(x[:0], True), torch.zeros(5, dtype=x.dtype))
    assert torch.equal(ordered_token_sum(x, False), x.sum(0))


@pytest.mark.parametrize(
    "A_log, dt_bias, exc, pattern",
    [
        (None, torch.zeros(2), ValueError, "needs A_log"),
        (torch.zeros(3), torch.zeros(2), ValueError, r"A_log must have shape \(2,\)"),
        (torch.zeros(2), [0.0, 0.0], TypeError, "dt_bias must be a torch.Tensor"),
        (torch.zeros(2, dtype=torch.int64), torch.zeros(2), TypeError, "A_log has dtype"),
        (torch.zeros(2), torch.zeros(2, device="meta"), ValueError, "dt_bias is on meta"),
    ],
)
def test_bad_parameters(A_log, dt_bias, exc, pattern):
    with pytest.raises(exc, match=pattern):
        gdn_gate(torch.zeros(1, 4, 2), A_log, dt_bias)
