"""The autograd call against the fp32 token-by-token oracle."""

from __future__ import annotations

import pytest
import torch

from gdn_core.testkit import assert_close, make_inputs, reference_gdn, run_fwd_bwd

LENGTHS = [1, 63, 64, 65, 100]


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
def test_varlen_grouped_heads_state(api, l2norm, gate):
    # documents of 1, 63, 64, 65, 100 tokens; H=1 q/k head serving HV=2 value
    # heads; initial state in, final state out, gradients for every input.
    inputs, cu, cot = make_inputs(LENGTHS, H=1, HV=2, seed=1, gate=gate)
    got = run_fwd_bwd(api.autograd, inputs, cu, cot, l2norm=l2norm)
    ref = run_fwd_bwd(reference_gdn, inputs, cu, cot, l2norm=l2norm)
    assert got["o"].dtype == torch.float32 and got["ht"].dtype == torch.float32
    assert_close(got, ref, rtol=2e-5)
    if gate:
        assert got["dA_log"].shape == (2,) and got["ddt_bias"].shape == (2,)


def test_fixed_length_batch_without_state(api):
    inputs, cu, cot = make_inputs(B=2, T=70, H=2, HV=2, K=32, V=16, initial_state=False, seed=2)
    got = run_fwd_bwd(api.autograd, inputs, cu, cot, scale=0.3,
                      output_final_state=False)
    ref = run_fwd_bwd(reference_gdn, inputs, cu, cot, scale=0.3, output_final_state=False)
    assert got["ht"] is None and got["dinitial_state"] is None
    assert_close(got, ref, rtol=2e-5)


def test_cu_seqlens_as_list_and_empty_document(api):
    inputs, cu, cot = make_inputs([5, 0, 70], seed=3, cu_as_list=True)
    got = run_fwd_bwd(api.autograd, inputs, cu, cot)
    ref = run_fwd_bwd(reference_gdn, inputs, cu, cot)
    assert_close(got, ref, rtol=2e-5)
    # the empty document passes its initial state through unchanged
    assert torch.equal(got["ht"][1], inputs["initial_state"][1])


def test_layout_built_in_the_call_lives_until_backward(api):
    """A ``VarlenLayout`` made in the call expression: the backward still finds it
    (the op reaches it through a handle; the autograd node holds it)."""
    import gc

    from gdn_core.layout import VarlenLayout

    inputs, cu, cot = make_inputs([5, 70], seed=4, cu_as_list=True)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in inputs.items()
              if x is not None}
    o, _ = api.autograd(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                        cu_seqlens=VarlenLayout(cu), segment_size=0)
    gc.collect()
    (o.float() * cot["do"].float()).sum().backward()
    want = run_fwd_bwd(api.autograd, {**inputs, "initial_state": None}, cu, cot,
                       output_final_state=False)
    assert torch.equal(o.detach(), want["o"])


def test_bf16_inputs_on_cpu(api):
    inputs, cu, cot = make_inputs([20, 50], dtype=torch.bfloat16, seed=4, gate=True)
    got = run_fwd_bwd(api.autograd, inputs, cu, cot, l2norm=True)
    ref = run_fwd_bwd(reference_gdn, inputs, cu, cot, l2norm=True)
    for name in ("q", "k", "v", "beta"):
        assert got["d" + name].dtype == torch.bfloat16
    assert got["o"].dtype == torch.bfloat16
    assert_close(got, ref, rtol=2e-2)


@pytest.mark.parametrize("gate", [False, True])
def test_gradcheck_float64(api, gate):
    inputs, cu, _ = make_inputs([5, 7], dtype=torch.float64, seed=5, gate=gate)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
             if inputs[n] is not None]
    leaves = [inputs[n].clone().requires_grad_() for n in names]

    def fn(*xs):
        kw = dict(zip(names, xs))
        extra = {}
        if gate:
            extra = dict(use_gate_in_kernel=True, A_log=kw["A_log"], dt_bias=kw["dt_bias"])
        return api.autograd(
            kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], initial_state=kw["initial_state"],
            output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, **extra,
        )

    assert torch.autograd.gradcheck(fn, leaves, atol=1e-6, fast_mode=True)


def test_inputs_without_grad_and_unused_final_state(api):
    inputs, cu, _ = make_inputs([30], seed=6)
    q = inputs["q"].clone().requires_grad_()
    o, ht = api.autograd(q, inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                       output_final_state=True, cu_seqlens=cu)
    o.sum().backward()  # ht unused: its gradient is None
    ref_q = inputs["q"].clone().requires_grad_()
    o_ref, _ = reference_gdn(ref_q, inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                             cu_seqlens=cu)
    o_ref.sum().backward()
    assert (q.grad - ref_q.grad).abs().max() < 1e-5
