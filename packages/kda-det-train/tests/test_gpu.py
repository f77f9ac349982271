"""CUDA: accuracy against the oracle (fp32 and bf16) and bitwise repeatability.

Run on the H200 machine: ``python -m pytest -q -m gpu packages/kda-det-train/tests``.
"""

from __future__ import annotations

import pytest
import torch
from kda_det_train import chunk_kda_det, naive_recurrent_kda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LENGTHS = [1, 63, 64, 65, 200, 700]
KEYS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def _to(d: dict, device) -> dict:
    return {n: None if x is None else x.to(device) for n, x in d.items()}


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "dtype, rtol",
    [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("g_min", [-1.0, -5.0])
def test_cuda_matches_oracle(dtype, rtol, g_min, make_inputs, run_fwd_bwd):
    inputs, cu, cot = make_inputs(LENGTHS, H=2, HV=4, K=64, V=64, dtype=dtype, g_min=g_min,
                                  seed=40)
    got = run_fwd_bwd(chunk_kda_det, _to(inputs, "cuda"), cu.cuda(), _to(cot, "cuda"),
                      l2norm=True)
    # The oracle runs on the CPU in fp32 on exactly the (bf16-rounded) input values.
    ref = run_fwd_bwd(naive_recurrent_kda, _to(inputs, "cpu"), cu, _to(cot, "cpu"), l2norm=True)
    assert got["o"].dtype == dtype and got["ht"].dtype == torch.float32
    errs = {}
    for key in KEYS:
        assert got[key].is_cuda and torch.isfinite(got[key]).all(), key
        errs[key] = _rel(got[key], ref[key])
    print(f"{dtype} g_min={g_min}: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
    assert max(errs.values()) < rtol, errs


def test_cuda_bitwise_repeat(make_inputs, run_fwd_bwd):
    inputs, cu, cot = make_inputs(LENGTHS + [3000], H=4, HV=8, K=128, V=128,
                                  dtype=torch.bfloat16, g_min=-5.0, seed=41, device="cuda")
    first = run_fwd_bwd(chunk_kda_det, inputs, cu, cot, l2norm=True)
    second = run_fwd_bwd(chunk_kda_det, inputs, cu.cuda(), cot, l2norm=True)
    for key in KEYS:
        assert torch.equal(first[key], second[key]), f"{key} differs between calls"


def test_cuda_matches_cpu_chunked(make_inputs, run_fwd_bwd):
    inputs, cu, cot = make_inputs(LENGTHS, H=2, HV=4, K=32, V=32, seed=42)
    on_gpu = run_fwd_bwd(chunk_kda_det, _to(inputs, "cuda"), cu, _to(cot, "cuda"))
    on_cpu = run_fwd_bwd(chunk_kda_det, inputs, cu, cot)
    for key in KEYS:
        assert _rel(on_gpu[key], on_cpu[key]) < 1e-5, key


def test_cuda_bitwise_across_processes(process_digests):
    first, second = process_digests("cuda")
    assert first == second
