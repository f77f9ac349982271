"""chunk_kda_det against the token-by-token oracle, forward and backward."""

from __future__ import annotations

import pytest
import torch
from kda_det_train import chunk_kda_det, naive_recurrent_kda

LENGTHS = [1, 63, 64, 65, 200]
KEYS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(got, ref, rtol, atol_scale, keys=KEYS):
    """Relative Frobenius error per tensor, and elementwise error relative to max |ref|."""
    for key in keys:
        a, b = got[key], ref[key]
        if b is None:
            assert a is None, key
            continue
        assert a.shape == b.shape, (key, a.shape, b.shape)
        assert torch.isfinite(a).all(), f"{key}: non-finite values"
        err = rel_err(a, b)
        max_err = (a.double() - b.double()).abs().max().item()
        bound = atol_scale * b.double().abs().max().item()
        assert err < rtol and max_err <= bound, f"{key}: rel {err:.2e}, max abs {max_err:.2e}"


@pytest.mark.parametrize("l2norm", [False, True])
def test_varlen_grouped_heads_state(l2norm, make_inputs, run_fwd_bwd):
    # lengths 1, 63, 64, 65, 200; H=2 q/k heads serving HV=4 value heads;
    # initial state in, final state out, gradients for everything.
    inputs, cu, cot = make_inputs(LENGTHS, H=2, HV=4, K=32, V=16, seed=1)
    got = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, l2norm=l2norm)
    ref = run_fwd_bwd(naive_recurrent_kda, inputs, cu, cot, l2norm=l2norm)
    assert got["o"].dtype == torch.float32 and got["ht"].dtype == torch.float32
    assert_close(got, ref, rtol=2e-5, atol_scale=2e-5)


def test_fixed_length_batch_without_state(make_inputs, run_fwd_bwd):
    inputs, cu, cot = make_inputs(B=2, T=130, H=2, HV=2, K=16, V=24, initial_state=False, seed=2)
    got = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, scale=0.3)
    ref = run_fwd_bwd(naive_recurrent_kda, inputs, cu, cot, scale=0.3)
    assert got["dinitial_state"] is None
    assert_close(got, ref, rtol=2e-5, atol_scale=2e-5)


def test_no_final_state_output(make_inputs, run_fwd_bwd):
    inputs, cu, cot = make_inputs([70, 10], H=1, HV=2, K=16, V=8, seed=3)
    got = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, output_final_state=False)
    ref = run_fwd_bwd(naive_recurrent_kda, inputs, cu, cot, output_final_state=False)
    assert got["ht"] is None
    assert_close(got, ref, rtol=2e-5, atol_scale=2e-5)


def test_float64_matches_to_roundoff(make_inputs, run_fwd_bwd):
    """In float64 the chunked algebra (explicit backward included) is exact to round-off."""
    inputs, cu, cot = make_inputs([5, 64, 130], H=1, HV=2, K=16, V=8, dtype=torch.float64,
                                  g_min=-3.0, seed=4)
    got = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, l2norm=True)
    ref = run_fwd_bwd(naive_recurrent_kda, inputs, cu, cot, l2norm=True)
    assert got["o"].dtype == torch.float64
    assert_close(got, ref, rtol=1e-12, atol_scale=1e-12)


@pytest.mark.parametrize("g_min", [-5.0, -30.0])
def test_strongly_decaying_channels(g_min, make_inputs, run_fwd_bwd):
    """g down to −5 (and −30) per token: exp(G) underflows within a chunk.

    Half of the channels decay hard, the others barely, so that the state keeps
    long-range content in some channels while the hard ones would overflow any
    factorisation through exp(−G).
    """
    inputs, cu, cot = make_inputs([200, 65], H=2, HV=2, K=32, V=16, seed=5)
    g = inputs["g"].clone()
    g[..., ::2] = torch.rand(g[..., ::2].shape, generator=torch.Generator().manual_seed(6)) * g_min
    g[..., 1::2] *= 0.02
    inputs["g"] = g
    got = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, l2norm=True)
    ref = run_fwd_bwd(naive_recurrent_kda, inputs, cu, cot, l2norm=True)
    assert_close(got, ref, rtol=5e-5, atol_scale=5e-5)


def test_empty_document_and_short_tail(make_inputs, run_fwd_bwd):
    """A zero-length document passes its initial state through (and dht back to dh0)."""
    inputs, cu, cot = make_inputs([3, 0, 64, 0], H=1, HV=1, K=16, V=16, seed=7)
    got = run_fwd_bwd(chunk_kda_det, inputs, cu, cot)
    ref = run_fwd_bwd(naive_recurrent_kda, inputs, cu, cot)
    assert_close(got, ref, rtol=2e-5, atol_scale=2e-5)
    assert torch.equal(got["ht"][1], inputs["initial_state"][1])
    assert torch.equal(got["dinitial_state"][3], cot["dht"][3])


def test_zero_tokens(make_inputs, run_fwd_bwd):
    inputs, cu, cot = make_inputs(B=2, T=0, H=1, HV=2, K=8, V=8, seed=8)
    got = run_fwd_bwd(chunk_kda_det, inputs, cu, cot)
    assert got["o"].shape == (2, 0, 2, 8)
    assert torch.equal(got["ht"], inputs["initial_state"])
    assert torch.equal(got["dinitial_state"], cot["dht"])


def test_bf16_inputs_on_cpu(make_inputs, run_fwd_bwd):
    """bf16 in → bf16 out and bf16 gradients, fp32 inside; compared on the same bf16 values."""
    inputs, cu, cot = make_inputs([100, 40], H=1, HV=2, K=32, V=16, dtype=torch.bfloat16, seed=9)
    got = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, l2norm=True)
    ref = run_fwd_bwd(naive_recurrent_kda, inputs, cu, cot, l2norm=True)
    assert got["o"].dtype == torch.bfloat16 and got["dg"].dtype == torch.bfloat16
    assert got["ht"].dtype == torch.float32
    assert_close(got, ref, rtol=1e-2, atol_scale=2e-2)


def test_partial_requires_grad(make_inputs):
    inputs, cu, _ = make_inputs([70], H=1, HV=1, K=8, V=8, seed=10)
    v = inputs["v"].clone().requires_grad_()
    o, _ = chunk_kda_det(inputs["q"], inputs["k"], v, inputs["g"], inputs["beta"], cu_seqlens=cu)
    o.sum().backward()
    v_ref = inputs["v"].clone().requires_grad_()
    o_ref, _ = naive_recurrent_kda(inputs["q"], inputs["k"], v_ref, inputs["g"], inputs["beta"],
                                   cu_seqlens=cu)
    o_ref.sum().backward()
    assert rel_err(v.grad, v_ref.grad) < 2e-5
