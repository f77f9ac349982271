"""The gated RMSNorm's Triton kernels (under the interpreter without a GPU) against its
torch form: output and every gradient, with and without a gate, both activations,
rows spanning several programs; and bitwise repeatable."""

from __future__ import annotations

import pytest
import torch
from gdn_core.layers.norm import rms_norm_gated_torch
from gdn_core.layers.norm_kernel import ROWS_PER_PROGRAM, GatedRMSNormFunction


def _grads(fn, x, gate, weight, dy, activation):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (x, gate, weight)]
    y = fn(leaves[0], leaves[1], leaves[2], 1e-6, activation)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("activation, gated, rows, D", [
    ("silu", True, 2 * ROWS_PER_PROGRAM + 37, 32),
    ("sigmoid", True, 50, 48),
    ("silu", False, 70, 16),
])
def test_kernel_matches_torch(activation, gated, rows, D):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, D, generator=gen)
    gate = torch.randn(rows, D, generator=gen) if gated else None
    weight = 0.5 + torch.rand(D, generator=gen)
    dy = torch.randn(rows, D, generator=gen)

    def kernel(x, g, w, eps, act):
        return GatedRMSNormFunction.apply(x, g, w, eps, act)

    got = _grads(kernel, x, gate, weight, dy, activation)
    want = _grads(rms_norm_gated_torch, x, gate, weight, dy, activation)
    assert len(got) == len(want) == (4 if gated else 3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    again = _grads(kernel, x, gate, weight, dy, activation)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
