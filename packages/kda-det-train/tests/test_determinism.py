"""Bitwise repeatability: across calls, across processes, across precision settings."""

from __future__ import annotations

import torch
from kda_det_train import chunk_kda_det, chunk_kda_det_bwd, chunk_kda_det_fwd

LENGTHS = [1, 63, 64, 65, 200]


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if a[key] is None:
            assert b[key] is None, key
        else:
            assert torch.equal(a[key], b[key]), f"{key} differs between runs"


def test_repeat_calls_bitwise(make_inputs, run_fwd_bwd):
    inputs, cu, cot = make_inputs(LENGTHS, H=2, HV=4, K=32, V=16, g_min=-5.0, seed=20)
    first = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, l2norm=True)
    second = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, l2norm=True)
    _equal(first, second)


def test_fwd_bwd_api_equals_autograd(make_inputs, run_fwd_bwd):
    inputs, cu, cot = make_inputs(LENGTHS, H=2, HV=4, K=32, V=16, seed=21)
    via_autograd = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, l2norm=True)
    o, ht, saved = chunk_kda_det_fwd(*(inputs[n] for n in ("q", "k", "v", "g", "beta")),
                                     initial_state=inputs["initial_state"],
                                     output_final_state=True, cu_seqlens=cu,
                                     use_qk_l2norm_in_kernel=True)
    grads = chunk_kda_det_bwd(saved, cot["do"], cot["dht"])
    direct = {"o": o, "ht": ht, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv, "dg": grads.dg,
              "dbeta": grads.dbeta, "dinitial_state": grads.dh0}
    _equal(direct, via_autograd)


def test_independent_of_global_matmul_precision(make_inputs, run_fwd_bwd):
    """A caller's float32 matmul precision (TF32 / bf16 products) changes no bit."""
    inputs, cu, cot = make_inputs([100, 50], H=1, HV=2, K=32, V=16, seed=22)
    reference = run_fwd_bwd(chunk_kda_det, inputs, cu, cot)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        relaxed = run_fwd_bwd(chunk_kda_det, inputs, cu, cot)
        assert torch.get_float32_matmul_precision() == "medium"  # restored after the call
    finally:
        torch.set_float32_matmul_precision(previous)
    _equal(reference, relaxed)


def test_bitwise_across_processes(process_digests):
    first, second = process_digests("cpu")
    assert set(first) == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    assert first == second
