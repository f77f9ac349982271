"""Strong decay in a partial last chunk: gradients stay finite and right.

Regression: the chunked reference padded the cumulative decay ``G`` with zeros,
so ``exp(G_pad − G_j)`` overflowed for a document whose last chunk is partial
and whose within-chunk decay sums below about −88, and ``0 · inf`` made the
backward NaN (the forward stayed finite).
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import chunk_gdn_bwd, chunk_gdn_fwd, naive_recurrent_gdn


def _inputs(T: int, g_value: float, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, T, 1, 16, generator=gen, dtype=dtype)
    k = torch.randn(1, T, 1, 16, generator=gen, dtype=dtype)
    v = torch.randn(1, T, 1, 16, generator=gen, dtype=dtype)
    g = torch.full((1, T, 1), g_value, dtype=dtype)
    beta = torch.rand(1, T, 1, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("T, cu", [(41, None), (105, [0, 41, 105])])
def test_strong_decay_partial_chunk_gradients_finite_and_right(backend, T, cu):
    q, k, v, g, beta = _inputs(T, -2.2)
    o, _, saved = chunk_gdn_fwd(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                deterministic=True, backend=backend)
    do = torch.randn_like(o)
    grads = chunk_gdn_bwd(saved, do, deterministic=True)

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o_ref, _ = naive_recurrent_gdn(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    ref = torch.autograd.grad(o_ref, leaves, do)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"),
                               (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta), ref):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
