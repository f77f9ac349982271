"""Smoke entry point: a tiny CPU forward + backward, checked against the oracle."""

from __future__ import annotations

import torch

from kda_det_train.chunk import chunk_kda_det
from kda_det_train.naive import naive_recurrent_kda


def run() -> None:
    gen = torch.Generator().manual_seed(0)
    T, H, HV, K, V = 70, 1, 2, 8, 4

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = rand(1, T, H, K), rand(1, T, H, K)
    v = rand(1, T, HV, V)
    g = -torch.rand(1, T, HV, K, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = rand(2, HV, K, V)
    cu = torch.tensor([0, 30, T])
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_kda_det(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                          cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    (o.square().sum() + ht.square().sum()).backward()
    ref_o, ref_ht = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                        output_final_state=True, cu_seqlens=cu,
                                        use_qk_l2norm_in_kernel=True)
    err = max((o - ref_o).abs().max().item(), (ht - ref_ht).abs().max().item())
    if not err < 1e-4:
        raise AssertionError(f"kda_det_train smoke: chunked vs oracle max error {err}")
    for x in inputs:
        if x.grad is None or not torch.isfinite(x.grad).all():
            raise AssertionError("kda_det_train smoke: missing or non-finite gradient")
