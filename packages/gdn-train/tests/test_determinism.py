"""The fast package makes no bitwise promise, but repeated runs agree within
tolerance (and with the deterministic reductions)."""

from __future__ import annotations

import torch
from gdn_core.conv1d import causal_conv1d as core_conv1d
from gdn_core.testkit import assert_close, make_inputs, run_fwd_bwd
from gdn_train import causal_conv1d, chunk_gated_delta_rule

LENGTHS = [1, 63, 64, 65, 150]


def test_repeat_calls_agree():
    inputs, cu, cot = make_inputs(LENGTHS, H=1, HV=2, seed=20, gate=True)
    first = run_fwd_bwd(chunk_gated_delta_rule, inputs, cu, cot, l2norm=True)
    again = run_fwd_bwd(chunk_gated_delta_rule, inputs, cu, cot, l2norm=True)
    assert_close(again, first, rtol=1e-6)


def test_conv1d_agrees_with_fixed_order_reduction():
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(1, 3000, 24, generator=gen)  # several token blocks
    w = torch.randn(24, 4, generator=gen)
    b = torch.randn(24, generator=gen)
    dy = torch.randn(1, 3000, 24, generator=gen)
    cu = [0, 1000, 1001, 3000]
    grads = []
    for fn in (causal_conv1d, lambda *a: core_conv1d(*a, deterministic=True)):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs, "silu", cu)
        (y * dy).sum().backward()
        grads.append((y.detach(), xs.grad, ws.grad, bs.grad))
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-4)
