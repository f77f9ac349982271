"""The gated RMSNorm's Triton kernels (on the GPU, or under the interpreter without one)
against its torch form: output and every gradient, with and without a gate, both
activations, rows spanning several programs; bitwise repeatable; bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch
from gdn_core.layers.norm import rms_norm_gated_torch
from gdn_core.layers.norm_kernel import ROWS_PER_PROGRAM, GatedRMSNormFunction

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel(x, g, w, eps, act):
    return GatedRMSNormFunction.apply(x, g, w, eps, act)


def _inputs(rows: int, D: int, gated: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(rows)
    x, gate, dy = (torch.randn(rows, D, generator=gen) for _ in range(3))
    weight = 0.5 + torch.rand(D, generator=gen)
    return [t.to(DEVICE, dtype) if t is not None else None
            for t in (x, gate if gated else None, weight, dy)]


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
    x, gate, weight, dy = _inputs(rows, D, gated)
    got = _grads(_kernel, x, gate, weight, dy, activation)
    want = _grads(rms_norm_gated_torch, x, gate, weight, dy, activation)
    assert len(got) == len(want) == (4 if gated else 3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    again = _grads(_kernel, x, gate, weight, dy, activation)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_gate_view_of_a_projection_is_read_in_place():
    """The gate as a layer passes it (heads of a wider projection's columns, a strided
    view) gives the same bits as a contiguous copy, in the output and every gradient."""
    tokens, heads, D = 70, 3, 32
    x, _, weight, dy = _inputs(tokens * heads, D, False)
    x, dy = x.view(tokens, heads, D), dy.view(tokens, heads, D)
    proj = torch.randn(tokens, 8 + heads * D, generator=torch.Generator().manual_seed(5))

    def run(as_view: bool):
        leaf = proj.to(DEVICE).requires_grad_(True)
        gate = leaf[:, 8:].view(tokens, heads, D)  # strides (8 + heads * D, D, 1)
        assert not gate.is_contiguous()
        gate = gate if as_view else gate.contiguous()
        y = _kernel(x, gate, weight, 1e-6, "silu")
        y.backward(dy)
        return y.detach(), leaf.grad

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_kernel_against_fp32_torch():
    low = _inputs(4 * ROWS_PER_PROGRAM * 32, 128, True, torch.bfloat16)  # 32768 rows of V=128
    got = _grads(_kernel, *low, "silu")
    want = _grads(rms_norm_gated_torch, *[t.float() for t in low[:3]], low[3].float(), "silu")
    for a, b in zip(got, want):
        err = float((a.float() - b).abs().max() / b.abs().max())
        assert err < 2e-2, err
