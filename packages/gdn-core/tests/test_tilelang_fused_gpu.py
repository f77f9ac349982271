"""The experimental fused TileLang forward (``gdn_core.ops.tilelang.fused_forward``) on the GPU.

Runs only where TileLang imports and the GPU is sm_90 (the optional extra; the
H200 validation installs it). Against the fp32 reference (bf16 inputs), bitwise
repeatable, a non-finite key in one document leaves the others bit-equal, and the
recompute mode's ``h`` / ``v_new`` agree with the Triton state kernel's.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops.chunk_state import chunk_state_fwd
from gdn_core.ops.cumsum import chunk_cumsum_fwd
from gdn_core.ops.wy import inverse_for_backward, wy_fwd

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _problem(lengths, H, group, seed=0):
    from gdn_core.ops.tilelang import available

    if not available():
        pytest.skip("TileLang on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(seed)
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    T, HV, D = offs[-1], H * group, 128
    q = R.l2_normalize(torch.randn(T, H, D, generator=gen))
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen))
    v = torch.randn(T, HV, D, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * 0.3
    beta = torch.rand(T, HV, generator=gen)
    h0 = torch.randn(len(lengths), HV, D, D, generator=gen) * 0.1
    cuda = [x.cuda() for x in (q, k, v, g, beta, h0)]
    bf = [x.to(torch.bfloat16) for x in cuda[:3]]
    return offs, cuda, bf


@pytest.mark.parametrize("group", [1, 2])
def test_fused_forward_matches_reference_and_repeats(group):
    from gdn_core.ops.tilelang.fused_forward import fused_chunk_fwd_tl

    lengths = [100, 65, 612, 1]
    offs, (q, k, v, g, beta, h0), (qb, kb, vb) = _problem(lengths, 2, group)
    index = ChunkIndex.build(offs, "cuda")
    G = chunk_cumsum_fwd(g, index)
    A = inverse_for_backward(wy_fwd(kb, vb, beta, G, index, group)[0], kb, vb)
    scale = 128**-0.5
    o, _, _, fin = fused_chunk_fwd_tl(qb, kb, vb, A, G, beta, scale, index, group, h0,
                                      output_final_state=True)
    o2, _, _, fin2 = fused_chunk_fwd_tl(qb, kb, vb, A, G, beta, scale, index, group, h0,
                                        output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(fin, fin2)
    cu = torch.tensor(offs, device="cuda")
    o_r, f_r = R.chunk_gdn_reference(qb[None].float(), kb[None].float(), vb[None].float(),
                                     g[None], beta[None], scale, h0, True, cu)
    assert _rel(o, o_r[0]) < 2e-2
    assert _rel(fin, f_r) < 2e-2

    # a NaN in the last key of document 0 stays there
    bad = kb.clone()
    bad[offs[1] - 1, 0, 0] = float("nan")
    o_n, _, _, fin_n = fused_chunk_fwd_tl(qb, bad, vb, A, G, beta, scale, index, group, h0,
                                          output_final_state=True)
    assert torch.equal(o_n[offs[1]:], o[offs[1]:]) and torch.equal(fin_n[1:], fin[1:])


def test_fused_recompute_matches_the_triton_state_kernel():
    from gdn_core.ops.tilelang.fused_forward import fused_chunk_fwd_tl

    offs, (q, k, v, g, beta, h0), (qb, kb, vb) = _problem([300, 64, 129], 2, 2, seed=1)
    index = ChunkIndex.build(offs, "cuda")
    G = chunk_cumsum_fwd(g, index)
    A_inv, W, U = wy_fwd(kb, vb, beta, G, index, 2)
    A = inverse_for_backward(A_inv, kb, vb)
    h_t, vn_t, _ = chunk_state_fwd(kb, W, U, G, index, 2, h0)
    _, h, vn, _ = fused_chunk_fwd_tl(None, kb, vb, A, G, beta, 1.0, index, 2, h0,
                                     store_states=True, store_v_new=True)
    assert _rel(h, h_t) < 3e-2
    assert _rel(vn, vn_t) < 3e-2
