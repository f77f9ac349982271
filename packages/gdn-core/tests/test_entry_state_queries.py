"""``reference.entry_state_queries_ref``: the two identities an exact split without a second
walk rests on (``docs/exact_split.md``), checked in float64 against the token-by-token
recurrence on packed documents with short last chunks and grouped value heads:

* each document's outputs from an entry state ``S_in`` are its outputs from zero plus
  ``S_inᵀ q̃_t``, row by row;
* the gradient of a loss through those outputs with respect to ``S_in`` is
  ``Σ_t q̃_t ⊗ do_t`` (autograd of the recurrence against the token reduction).
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import document_bounds

LENGTHS = [150, 1, 64, 97]


def _problem(H, group, seed):
    gen = torch.Generator().manual_seed(seed)
    T, HV, K, V = sum(LENGTHS), H * group, 16, 8
    f64 = torch.float64
    q = torch.randn(1, T, H, K, generator=gen, dtype=f64)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen, dtype=f64)
    g = -torch.rand(1, T, HV, generator=gen, dtype=f64) * 0.3
    beta = torch.rand(1, T, HV, generator=gen, dtype=f64)
    h0 = torch.randn(len(LENGTHS), HV, K, V, generator=gen, dtype=f64)
    do = torch.randn(1, T, HV, V, generator=gen, dtype=f64)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return q, k, v, g, beta, h0, do, cu


def _queries(q, k, v, g, beta, cu, scale, group):
    bounds = document_bounds(cu, 1, q.shape[1])
    qe, ke = (x[0].repeat_interleave(group, dim=1) for x in (q, k))
    G = R.chunk_cumsum_ref(g[0], bounds)
    _, W, _ = R.wy_ref(ke, v[0], beta[0], G, bounds)
    return R.entry_state_queries_ref(qe, ke, W, G, scale, bounds), bounds


@pytest.mark.parametrize("H, group, seed", [(2, 1, 0), (1, 2, 1)])
def test_outputs_are_the_zero_entry_outputs_plus_the_entry_state_term(H, group, seed):
    q, k, v, g, beta, h0, _, cu = _problem(H, group, seed)
    scale = 0.37
    o_in, _ = R.naive_recurrent_gdn(q, k, v, g, beta, scale, h0, cu_seqlens=cu)
    o_0, _ = R.naive_recurrent_gdn(q, k, v, g, beta, scale, None, cu_seqlens=cu)
    qt, bounds = _queries(q, k, v, g, beta, cu, scale, group)
    for n, (bos, eos) in enumerate(bounds):
        term = torch.einsum("thk,hkv->thv", qt[bos:eos], h0[n])
        torch.testing.assert_close(o_0[0, bos:eos] + term, o_in[0, bos:eos], rtol=1e-10,
                                   atol=1e-10)


@pytest.mark.parametrize("H, group, seed", [(2, 1, 2), (1, 2, 3)])
def test_the_entry_state_gradient_is_a_token_reduction(H, group, seed):
    q, k, v, g, beta, h0, do, cu = _problem(H, group, seed)
    scale = 0.37
    h0 = h0.requires_grad_(True)
    o, _ = R.naive_recurrent_gdn(q, k, v, g, beta, scale, h0, cu_seqlens=cu)
    (dh0,) = torch.autograd.grad((o * do).sum(), h0)
    qt, bounds = _queries(q, k, v, g, beta, cu, scale, group)
    for n, (bos, eos) in enumerate(bounds):
        want = torch.einsum("thk,thv->hkv", qt[bos:eos], do[0, bos:eos])
        torch.testing.assert_close(want, dh0[n], rtol=1e-10, atol=1e-10)
    assert dh0.abs().max() > 0.1  # the identity is not vacuous: a real gradient


def test_a_document_without_tokens_has_no_rows():
    q, k, v, g, beta, _, _, _ = _problem(1, 1, 4)
    cu = torch.tensor([0, 0, q.shape[1]])
    qt, _ = _queries(q, k, v, g, beta, cu, 0.5, 1)
    assert qt.shape == (q.shape[1], 1, q.shape[-1])
