"""The Gluon WY kernel (``gdn_core.ops.gluon.wy``) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). Packed
documents with short last chunks (every 16-row block edge), grouped heads, bf16 and
fp16, 4 warps (the launcher's) and 8: against the fp32 reference of the stage
(``reference.wy_ref`` on the rounded inputs; ``A_inv`` 1e-4 relative to its largest
entry, W/U the Triton kernel's tolerance: fp16 5e-3, bf16 1e-2) and against the Triton
:func:`~gdn_core.ops.wy.wy_fwd`; bitwise repeatable; ``output_A_inv=False``,
``A_inv_for_backward=True`` (the 16-bit inverse rounded in the kernel: the fp32 one's
bits rounded) and a strided ``v`` view giving the same bits; each document's bits the
same when it is launched alone; a non-finite value in one document's rows (the rows a
short chunk before it reads through TMA) leaving the other documents' bits unchanged;
strongly coupled keys.
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
TOL_A = 1e-4
LENGTHS = [5, 64, 70, 1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 200]
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
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    v = torch.randn(T, HV, D, generator=gen).to("cuda", dtype)
    beta = (torch.rand(T, HV, generator=gen) * 0.9 + 0.05).to("cuda", dtype)
    g = (-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).cuda()
    G = chunk_cumsum_fwd(g, index)
    return offs, index, (k, v, beta, G)


def _expand(x, group):
    return x.float().repeat_interleave(group, dim=1)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, *LONG], ids=["short", "32k-1doc", "32k-9docs"])
def test_gluon_wy_matches_reference_triton_and_repeats(lengths, group, dtype, warps,
                                                       monkeypatch):
    from gdn_core.ops.gluon import wy as gw
    from gdn_core.ops.wy import wy_fwd

    monkeypatch.setattr(gw, "GLUON_WY_WARPS", warps)
    H = 2 if len(lengths) == len(LENGTHS) else 8
    offs, index, (k, v, beta, G) = _problem(lengths, H, group, dtype)
    A_inv, W, U = gw.wy_fwd_gluon(k, v, beta, G, index, group)
    assert A_inv.dtype == torch.float32 and A_inv.shape == (*v.shape[:2], 64)
    assert W.dtype == dtype and W.shape == (*v.shape[:2], 128)
    assert U.dtype == dtype and U.shape == v.shape
    A2, W2, U2 = gw.wy_fwd_gluon(k, v, beta, G, index, group)
    assert torch.equal(A2, A_inv) and torch.equal(W2, W) and torch.equal(U2, U)
    none, W3, U3 = gw.wy_fwd_gluon(k, v, beta, G, index, group, output_A_inv=False)
    assert none is None and torch.equal(W3, W) and torch.equal(U3, U)
    # the backward's copy, rounded in the kernel (TMA store of full chunks, masked rows of
    # short ones): the fp32 inverse's bits rounded, the same W and U
    a16, W4, U4 = gw.wy_fwd_gluon(k, v, beta, G, index, group, A_inv_for_backward=True)
    assert a16.dtype == dtype and torch.equal(a16, A_inv.to(dtype))
    assert torch.equal(W4, W) and torch.equal(U4, U)
    bounds = list(zip(offs[:-1], offs[1:]))
    A_ref, W_ref, U_ref = R.wy_ref(_expand(k, group), v.float(), beta.float(), G, bounds)
    assert max_rel_err(A_inv, A_ref) <= TOL_A
    assert max_rel_err(W, W_ref) <= TOL[dtype]
    assert max_rel_err(U, U_ref) <= TOL[dtype]
    A_tr, W_tr, U_tr = wy_fwd(k, v, beta, G, index, group)
    assert max_rel_err(A_inv, A_tr) <= TOL_A
    assert max_rel_err(W, W_tr) <= TOL[dtype] and max_rel_err(U, U_tr) <= TOL[dtype]
    # columns past each chunk's length are exact zeros
    for bos, eos in bounds:
        for start in range(bos, eos, 64):
            n = min(64, eos - start)
            assert (A_inv[start:start + n, :, n:] == 0).all()


@pytest.mark.parametrize("lengths", [LENGTHS, LONG[1]], ids=["short", "32k-9docs"])
def test_gluon_wy_merge_depth_keeps_the_bits(lengths, monkeypatch):
    """The 32x32 merge's FMA dots in slices of 16 (fewer registers, the default) give the
    bits of the whole dots: the same FMA chains."""
    from gdn_core.ops.gluon import wy as gw

    group = 2
    offs, index, (k, v, beta, G) = _problem(lengths, 2, group, torch.bfloat16, seed=5)
    monkeypatch.setattr(gw, "GLUON_WY_MERGE_K", 32)
    want = gw.wy_fwd_gluon(k, v, beta, G, index, group)
    want16 = gw.wy_fwd_gluon(k, v, beta, G, index, group, A_inv_for_backward=True)
    monkeypatch.setattr(gw, "GLUON_WY_MERGE_K", 16)
    got = gw.wy_fwd_gluon(k, v, beta, G, index, group)
    got16 = gw.wy_fwd_gluon(k, v, beta, G, index, group, A_inv_for_backward=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got16, want16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_wy_reads_strided_v_in_place(dtype):
    """``v`` as a view of a wider projection (the layer's packed q/k/v): the same bits."""
    from gdn_core.ops.gluon.wy import wy_fwd_gluon

    group = 2
    offs, index, (k, v, beta, G) = _problem(LENGTHS, 2, group, dtype, seed=2)
    T, HV, V = v.shape
    proj = torch.cat([torch.zeros(T, 3 * V, dtype=dtype, device="cuda"), v.reshape(T, HV * V)],
                     -1)
    view = proj[:, 3 * V:].view(T, HV, V)
    assert not view.is_contiguous()
    got = wy_fwd_gluon(k, view, beta, G, index, group)
    want = wy_fwd_gluon(k, v, beta, G, index, group)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    spread = torch.cat([v, v], -1)[..., :V]  # a head stride of its own: copied
    got = wy_fwd_gluon(k, spread, beta, G, index, group)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_wy_documents_are_independent(dtype):
    """Each document alone gives the packed launch's bits; NaN in a document's rows (which
    the short chunk before it loads past its end) stays in that document."""
    from gdn_core.ops.gluon.wy import wy_fwd_gluon

    group = 2
    lengths = [5, 64, 70, 33, 200]
    offs, index, (k, v, beta, G) = _problem(lengths, 2, group, dtype, seed=1)
    out = wy_fwd_gluon(k, v, beta, G, index, group)
    for d, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        sl = slice(bos, eos)
        got = wy_fwd_gluon(k[sl], v[sl], beta[sl], G[sl], one, group)
        for name, a, b in zip(("A_inv", "W", "U"), got, out):
            assert torch.equal(a, b[sl]), f"document {d}: {name}"

    for d in (1, 3):  # the first row of documents 1 and 3 (read by a short chunk before)
        row = offs[d]
        bad_k, bad_v = k.clone(), v.clone()
        bad_k[row] = float("nan")
        bad_v[row] = float("inf")
        got = wy_fwd_gluon(bad_k, bad_v, beta, G, index, group)
        for a, b in zip(got, out):
            assert torch.equal(a[:offs[d]], b[:offs[d]]), f"NaN in document {d} leaked backwards"
            assert torch.equal(a[offs[d + 1]:], b[offs[d + 1]:])


def test_gluon_wy_strong_coupling():
    """Nearly parallel keys with β ≈ 1: large inverse entries, still within tolerance."""
    from gdn_core.ops.gluon import available
    from gdn_core.ops.gluon.wy import wy_fwd_gluon

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(4)
    T = 128
    index = ChunkIndex.build([0, T], "cuda")
    base = torch.randn(1, 1, 128, generator=gen)
    k = R.l2_normalize(base + 0.05 * torch.randn(T, 1, 128, generator=gen)).to("cuda",
                                                                                torch.bfloat16)
    v = torch.randn(T, 1, 128, generator=gen).to("cuda", torch.bfloat16)
    beta = torch.full((T, 1), 0.99, device="cuda")
    G = torch.zeros(T, 1, device="cuda")
    A_inv, W, U = wy_fwd_gluon(k, v, beta, G, index, 1)
    A_ref, W_ref, U_ref = R.wy_ref(k.float(), v.float(), beta, G, [(0, T)])
    assert max_rel_err(A_inv, A_ref) <= TOL_A
    assert max_rel_err(W, W_ref) <= TOL[torch.bfloat16]
    assert max_rel_err(U, U_ref) <= TOL[torch.bfloat16]


def test_triton_wy_apply_from_the_gluon_inverse():
    """The backward's :func:`~gdn_core.ops.wy.wy_apply` on this kernel's (16-bit) inverse:
    W, U within rounding of the Gluon kernel's (not bitwise: another inverse's bits)."""
    from gdn_core.ops.gluon.wy import wy_fwd_gluon
    from gdn_core.ops.wy import inverse_for_backward, wy_apply

    dtype = torch.bfloat16
    offs, index, (k, v, beta, G) = _problem(LENGTHS, 2, 2, dtype, seed=3)
    A_inv, W, U = wy_fwd_gluon(k, v, beta, G, index, 2)
    W2, U2 = wy_apply(k, v, beta, G, inverse_for_backward(A_inv, k, v), index, 2)
    assert max_rel_err(W2, W.float()) <= TOL[dtype] and max_rel_err(U2, U.float()) <= TOL[dtype]
