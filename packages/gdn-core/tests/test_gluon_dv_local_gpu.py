"""The Gluon dv_local kernel (``gdn_core.ops.gluon.dv_local``) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). Packed
documents with short last chunks, grouped heads, bf16 and fp16, 4 warps (the
launcher's, at its 128-register cap and uncapped) and 8, the TMA store of full chunks
(the launcher's) and register stores only: against an fp32 reference of the stage
(fp16 5e-3 relative to the largest |dv|; bf16 1e-2, the project's bf16 tolerance),
against the Triton kernel, bitwise repeatable, into an ``out=`` buffer; strided views
read in place; each document's bits the same when it is launched alone, and a
non-finite value in one document's rows (the rows a short chunk before it reads through
TMA) leaving the other documents' bits unchanged.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import max_rel_err, offsets_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
LENGTHS = [5, 64, 70, 200, 3]
# 32K tokens: one document, and 9 documents with short last chunks (sum 32768)
LONG = [32768], [1, 4095, 63, 8191, 65, 10000, 3000, 7000, 353]


def _problem(lengths, H, group, dtype, seed=0):
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.gluon import available

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, HV, D = offs[-1], H * group, 128
    index = ChunkIndex.build(offs, "cuda")
    q = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    do = torch.randn(T, HV, D, generator=gen).to("cuda", dtype)
    g = (-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).cuda()
    G = chunk_cumsum_fwd(g, index)
    return offs, index, (q, k, G, do)


def _reference(q, k, G, do, scale, offs, group, C=64):
    """fp32 ``scale · (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j])ᵀ dO`` per chunk (batched over the
    full chunks of each document, the short last chunk on its own)."""
    T, H, K = q.shape
    HV, V = do.shape[1:]
    qf, kf = (x.float().repeat_interleave(group, dim=1) for x in (q, k))
    dof = do.float()
    out = torch.zeros(T, HV, V, device=q.device)
    for bos, eos in zip(offs[:-1], offs[1:]):
        nfull = (eos - bos) // C
        pieces = []
        if nfull:
            pieces.append((bos, nfull, C))
        if (eos - bos) % C:
            pieces.append((bos + nfull * C, 1, (eos - bos) % C))
        for t0, m, L in pieces:
            sl = slice(t0, t0 + m * L)
            qc, kc, dc = (x[sl].view(m, L, HV, -1) for x in (qf, kf, dof))
            g = G[sl].view(m, L, HV)
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            dec = (g[:, :, None, :] - g[:, None, :, :]).permute(0, 3, 1, 2)  # [m, HV, i, j]
            dec = dec.masked_fill(~causal, float("-inf")).exp()
            P = torch.einsum("mihk,mjhk->mhij", qc, kc) * dec * scale
            out[sl] = torch.einsum("mhij,mihv->mjhv", P, dc).reshape(m * L, HV, V)
    return out


@pytest.mark.parametrize("warps,tma_store,maxnreg",
                         [(4, True, 128), (4, True, None), (4, False, 128), (8, True, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, *LONG], ids=["short", "32k-1doc", "32k-9docs"])
def test_gluon_dv_local_matches_reference_triton_and_repeats(lengths, group, dtype, warps,
                                                             tma_store, maxnreg, monkeypatch):
    from gdn_core.ops.dv_local import dv_local_bwd
    from gdn_core.ops.gluon import dv_local as gd

    monkeypatch.setattr(gd, "GLUON_DV_LOCAL_WARPS", warps)
    monkeypatch.setattr(gd, "GLUON_DV_LOCAL_TMA_STORE", tma_store)
    monkeypatch.setattr(gd, "GLUON_DV_LOCAL_MAXNREG", maxnreg)
    H = 2 if len(lengths) == len(LENGTHS) else 8
    offs, index, (q, k, G, do) = _problem(lengths, H, group, dtype)
    scale = 128**-0.5
    dv = gd.dv_local_bwd_gluon(q, k, G, do, scale, index, group)
    assert dv.dtype == dtype and dv.shape == do.shape
    assert torch.equal(dv, gd.dv_local_bwd_gluon(q, k, G, do, scale, index, group))
    buf = torch.full_like(do, float("nan"))
    assert gd.dv_local_bwd_gluon(q, k, G, do, scale, index, group, out=buf) is buf
    assert torch.equal(buf, dv)  # every row written, the same bits
    assert max_rel_err(dv, _reference(q, k, G, do, scale, offs, group)) <= TOL[dtype]
    assert max_rel_err(dv, dv_local_bwd(q, k, G, do, scale, index, group)) <= TOL[dtype]


def test_gluon_dv_local_strided_inputs():
    """q, k, do as head-split views of packed projections (read in place by TMA)."""
    from gdn_core.ops.gluon.dv_local import dv_local_bwd_gluon

    offs, index, (q, k, G, do) = _problem(LENGTHS, 2, 2, torch.bfloat16, seed=2)
    T = q.shape[0]
    qk = torch.cat([q.flatten(1), k.flatten(1), torch.zeros_like(q.flatten(1))], 1)
    qv, kv = qk[:, :256].view(T, 2, 128), qk[:, 256:512].view(T, 2, 128)
    dop = torch.cat([do.flatten(1), do.flatten(1)], 1)[:, :512].view(T, 4, 128)
    assert not qv.is_contiguous() and not dop.is_contiguous()
    assert torch.equal(dv_local_bwd_gluon(qv, kv, G, dop, 0.3, index, 2),
                       dv_local_bwd_gluon(q, k, G, do, 0.3, index, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_dv_local_documents_are_independent(dtype):
    """Each document alone gives the packed launch's bits; NaN in a document's rows (which
    the short chunk before it loads past its end) stays in that document."""
    from gdn_core.ops.gluon.dv_local import dv_local_bwd_gluon

    group = 2
    offs, index, (q, k, G, do) = _problem(LENGTHS, 2, group, dtype, seed=1)
    scale = 0.37
    dv = dv_local_bwd_gluon(q, k, G, do, scale, index, group)
    for d, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        sl = slice(bos, eos)
        dv_d = dv_local_bwd_gluon(q[sl], k[sl], G[sl], do[sl], scale, one, group)
        assert torch.equal(dv_d, dv[sl]), f"document {d}"

    for d in (1, 3, 4):  # the first row of documents 1, 3, 4 (read by a short chunk before)
        row = offs[d]
        bad = [x.clone() for x in (q, k, do)]
        for x in bad:
            x[row] = float("nan")
        dv_n = dv_local_bwd_gluon(bad[0], bad[1], G, bad[2], scale, index, group)
        assert torch.equal(dv_n[:offs[d]], dv[:offs[d]]), f"NaN in document {d} leaked backwards"
        assert torch.equal(dv_n[offs[d + 1]:], dv[offs[d + 1]:])
