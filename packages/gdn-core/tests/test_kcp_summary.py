"""Per-fragment summaries: S_out = M S_in + S_ext against the chunk-state recurrence."""

from __future__ import annotations

import os

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.kcp.summary import fragment_summary
from gdn_core.reference import (
    chunk_cumsum_ref,
    chunk_states_ref,
    l2_normalize,
    wy_ref,
)


def _inputs(T, H, HV, K, V, seed=0, l2=False):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, T, H, K, generator=gen)
    if not l2:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -0.2 * torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    S0 = torch.randn(HV, K, V, generator=gen)
    return k, v, g, beta, S0


def _final_from(k, v, g, beta, start, stop, S0, l2):
    """The state after [start, stop) from S0, by the reference recurrence."""
    k, v, g, beta = (x[0, start:stop] for x in (k, v, g, beta))
    if l2:
        k = l2_normalize(k)
    k = k.repeat_interleave(v.shape[1] // k.shape[1], dim=1)
    bounds = [(0, stop - start)]
    G = chunk_cumsum_ref(g, bounds)
    _, W, U = wy_ref(k, v, beta, G, bounds)
    return chunk_states_ref(k, W, U, G, bounds, S0[None])[2][0]


@pytest.mark.parametrize("start,stop,l2,H,HV", [
    (0, 1, False, 1, 1),
    (0, 64, False, 1, 2),
    (5, 200, True, 2, 4),
    (63, 130, False, 1, 2),
])
def test_reference_summary_is_the_affine_map(start, stop, l2, H, HV):
    k, v, g, beta, S0 = _inputs(200, H, HV, 16, 32, l2=l2)
    M, E = fragment_summary(k, v, g, beta, start, stop, need_M=True, backend="reference",
                            use_qk_l2norm_in_kernel=l2)
    assert M.shape == (HV, 16, 16) and E.shape == (HV, 16, 32)
    want = _final_from(k, v, g, beta, start, stop, S0, l2)
    torch.testing.assert_close(M @ S0 + E, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(E, _final_from(k, v, g, beta, start, stop, 0 * S0, l2))
    M2, E2 = fragment_summary(k, v, g, beta, start, stop, need_M=False, backend="reference",
                              use_qk_l2norm_in_kernel=l2)
    assert M2 is None and torch.equal(E2, E)


def test_summary_bad_range():
    k, v, g, beta, _ = _inputs(10, 1, 1, 16, 16)
    with pytest.raises(ValueError):
        fragment_summary(k, v, g, beta, 5, 5, need_M=False, backend="reference")
    with pytest.raises(ValueError):
        fragment_summary(k, v, g, beta, 0, 11, need_M=False, backend="reference")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter or a GPU")
@pytest.mark.parametrize("l2,H,HV", [(False, 1, 2), (True, 2, 2)])
def test_triton_summary_matches_reference(l2, H, HV):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    k, v, g, beta, _ = (x.to(dev) for x in _inputs(90, H, HV, 16, 16, seed=4, l2=l2))
    start, stop = 10, 90
    index = ChunkIndex.build([0, stop - start], dev)
    M, E = fragment_summary(k, v, g, beta, start, stop, need_M=True, backend="triton",
                            use_qk_l2norm_in_kernel=l2, index=index)
    Mr, Er = fragment_summary(k, v, g, beta, start, stop, need_M=True, backend="reference",
                              use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(M, Mr, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(E, Er, rtol=1e-4, atol=1e-4)
