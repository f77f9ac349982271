"""The within-chunk building blocks against brute force."""

from __future__ import annotations

import pytest
import torch
from kda_det_train.intra import chunk_cumsum, decayed_gram, decayed_gram_bwd


def brute_gram(a, b, G, strict):
    e = torch.exp(G.unsqueeze(-2) - G.unsqueeze(-3))  # [..., i, j, D] = exp(G_i − G_j)
    P = (a.unsqueeze(-2) * b.unsqueeze(-3) * e).sum(-1)
    C = G.shape[-2]
    mask = torch.ones(C, C, dtype=torch.bool).tril(-1 if strict else 0)
    return P.masked_fill(~mask, 0)


@pytest.mark.parametrize("strict", [False, True])
def test_decayed_gram_and_adjoint(strict):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 64, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(3, 64, 8, generator=gen, dtype=torch.float64)
    G = chunk_cumsum(-torch.rand(3, 64, 8, generator=gen, dtype=torch.float64) * 0.2)
    a_, b_, G_ = (x.clone().requires_grad_() for x in (a, b, G))
    P_ref = brute_gram(a_, b_, G_, strict)
    P = decayed_gram(a, b, G, strict)
    torch.testing.assert_close(P, P_ref.detach(), rtol=1e-12, atol=1e-12)
    dP = torch.randn(3, 64, 64, generator=gen, dtype=torch.float64)  # upper part ignored
    P_ref.backward(dP)
    da, db = decayed_gram_bwd(dP, a, b, G, strict)
    torch.testing.assert_close(da, a_.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(db, b_.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a * da - b * db, G_.grad, rtol=1e-10, atol=1e-10)


def test_decayed_gram_fast_decay_is_finite():
    """g = −5 per token: exp(−G) would reach e^320; the split keeps every factor ≤ 1."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(64, 4, generator=gen)
    G = chunk_cumsum(torch.full((64, 4), -5.0))
    P = decayed_gram(a, a, G, strict=False)
    assert torch.isfinite(P).all()
    ref = brute_gram(a.double(), a.double(), G.double(), strict=False)
    torch.testing.assert_close(P.double(), ref, rtol=1e-5, atol=1e-6)


def test_chunk_cumsum():
    x = torch.randn(5, 64, 3, dtype=torch.float64)
    torch.testing.assert_close(chunk_cumsum(x), x.cumsum(-2))
    torch.testing.assert_close(chunk_cumsum(x, reverse=True), x.flip(-2).cumsum(-2).flip(-2))
