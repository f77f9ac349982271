"""The fused state + output kernel against the fp32 reference and the two-kernel path.

Without a GPU the kernels run under the Triton interpreter (``conftest.py``):
fp32 and fp16 only (``tl.dot`` on bf16 is wrong in the interpreter). With one,
the same tests run on CUDA, and the ``gpu`` cases add bf16 at real head sizes.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import chunk_output_fwd, chunk_state_fwd, chunk_state_output_fwd, record_launches

# empty, one token, one short of / exactly / one past a chunk, three chunks
VARLEN = [0, 1, 63, 64, 65, 150]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
DIMS = [(1, 2, 48, 32), (2, 2, 16, 48), (1, 1, 16, 80)]  # grouped heads; V over one block
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _offsets(lengths):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return offs


def _rel_err(actual, expected):
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _stage_inputs(lengths, H, HV, K, V, dtype, seed, g_scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    offs = _offsets(lengths)
    T = offs[-1]
    q = R.l2_normalize(torch.randn(T, H, K, generator=gen))
    k = R.l2_normalize(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, HV, V, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * g_scale - 0.01
    beta = torch.rand(T, HV, generator=gen) * 0.9 + 0.05
    bounds = list(zip(offs[:-1], offs[1:]))
    G = R.chunk_cumsum_ref(g, bounds)
    ke = k.repeat_interleave(HV // H, dim=1)
    _, W, U = R.wy_ref(ke, v, beta, G, bounds)
    h0 = torch.randn(len(bounds), HV, K, V, generator=gen)
    q, k, W, U = (x.to(DEVICE, dtype) for x in (q, k, W, U))
    return offs, bounds, q, k, W, U, G.to(DEVICE), h0.to(DEVICE)


def _reference(q, k, W, U, G, h0, scale, bounds, group):
    """fp32 states then outputs (on the CPU), from the kernel's own (rounded) inputs."""
    qe, ke = (x.float().cpu().repeat_interleave(group, dim=1) for x in (q, k))
    h0 = None if h0 is None else h0.cpu()
    h_ref, vn_ref, final_ref = R.chunk_states_ref(ke, W.float().cpu(), U.float().cpu(),
                                                  G.cpu(), bounds, h0)
    return R.chunk_output_ref(qe, ke, vn_ref, h_ref, G.cpu(), scale, bounds), final_ref


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("use_h0", [True, False])
def test_state_output_vs_reference(dims, dtype, use_h0):
    H, HV, K, V = dims
    group = HV // H
    offs, bounds, q, k, W, U, G, h0 = _stage_inputs(VARLEN, H, HV, K, V, dtype, seed=3)
    h0 = h0 if use_h0 else None
    index = ChunkIndex.build(offs, DEVICE)
    o, final = chunk_state_output_fwd(q, k, W, U, G, 0.37, index, group, h0,
                                      output_final_state=True)
    o_ref, final_ref = _reference(q, k, W, U, G, h0, 0.37, bounds, group)
    assert o.dtype == dtype and final.dtype == torch.float32
    assert _rel_err(o.cpu(), o_ref) <= TOL[dtype]
    assert _rel_err(final.cpu(), final_ref) <= TOL[dtype]
    # the empty first document passes its initial state through unchanged
    assert torch.equal(final[0], h0[0] if use_h0 else torch.zeros_like(final[0]))

    # the same numbers as the two-kernel path it replaces (same roundings of S and V')
    h, v_new, final2 = chunk_state_fwd(k, W, U, G, index, group, h0, output_final_state=True)
    o2 = chunk_output_fwd(q, k, v_new, h, G, 0.37, index, group)
    assert _rel_err(o, o2) <= TOL[dtype]
    assert torch.equal(final, final2) or _rel_err(final, final2) <= TOL[dtype]


def test_state_output_strong_decay_does_not_overflow():
    """exp(G_i − G_j) for i < j would overflow at this decay; it must never be formed."""
    offs, bounds, q, k, W, U, G, h0 = _stage_inputs([100], 1, 1, 16, 16, torch.float32, seed=4,
                                                    g_scale=0.0)
    G = R.chunk_cumsum_ref(torch.full((100, 1), -30.0), bounds).to(DEVICE)
    index = ChunkIndex.build(offs, DEVICE)
    o, final = chunk_state_output_fwd(q, k, W, U, G, 1.0, index, 1, h0, output_final_state=True)
    o_ref, final_ref = _reference(q, k, W, U, G, h0, 1.0, bounds, 1)
    assert _rel_err(o.cpu(), o_ref) <= 1e-5
    assert _rel_err(final.cpu(), final_ref) <= 1e-5


def test_state_output_repeatable_without_atomics():
    offs, _, q, k, W, U, G, h0 = _stage_inputs(VARLEN, 1, 2, 16, 16, torch.float32, seed=5)
    index = ChunkIndex.build(offs, DEVICE)
    with record_launches() as launches:
        a = chunk_state_output_fwd(q, k, W, U, G, 0.5, index, 2, h0, output_final_state=True)
    b = chunk_state_output_fwd(q, k, W, U, G, 0.5, index, 2, h0, output_final_state=True)
    assert launches and not [x for x in launches if x.uses_atomics]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_state_output_rejects_bad_shapes():
    offs, _, q, k, W, U, G, _ = _stage_inputs([70], 1, 1, 16, 16, torch.float32, seed=6)
    index = ChunkIndex.build(offs, DEVICE)
    with pytest.raises(ValueError, match="shape mismatch"):
        chunk_state_output_fwd(q, k, W[:-1], U, G, 1.0, index, 1)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_state_output_fwd(q, k, W, U, G, 1.0, index, 1,
                               torch.zeros(2, 1, 16, 16, device=DEVICE))


GPU_CASES = [
    pytest.param([1000, 0, 64, 700, 1], 4, 1, 128, 128, id="K128-V128"),
    pytest.param([500, 300], 2, 2, 64, 256, id="grouped-K64-V256"),
    pytest.param([300, 129], 1, 4, 256, 64, id="group4-K256-V64"),
    pytest.param([333], 2, 1, 80, 112, id="K80-V112"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("lengths,H,group,K,V", GPU_CASES)
def test_state_output_gpu(lengths, H, group, K, V, dtype):
    """Real head sizes on the GPU, bf16 included: fp32 reference, repeatable bits."""
    offs, bounds, q, k, W, U, G, h0 = _stage_inputs(lengths, H, H * group, K, V, dtype, seed=7)
    index = ChunkIndex.build(offs, DEVICE)
    runs = [chunk_state_output_fwd(q, k, W, U, G, K**-0.5, index, group, h0,
                                   output_final_state=True) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    o_ref, final_ref = _reference(q, k, W, U, G, h0, K**-0.5, bounds, group)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    assert _rel_err(runs[0][0].cpu(), o_ref) <= tol
    assert _rel_err(runs[0][1].cpu(), final_ref) <= tol
