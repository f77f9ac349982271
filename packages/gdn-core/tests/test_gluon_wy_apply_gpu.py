"""The Gluon WY apply kernel (``gdn_core.ops.gluon.wy.wy_apply_gluon``) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). The inverse
as the backward holds it (``inverse_for_backward`` of the Triton ``wy_fwd``'s: 16-bit)
and fp32; packed documents with short last chunks (every 16-row block edge), group 1 and
2, bf16 and fp16, 4 warps (the launcher's), 8, and 4 capped at 96 registers: against the
fp32 reference of the stage (``reference.wy_ref``'s W, U on the rounded inputs; fp16
5e-3, bf16 1e-2 relative to the largest entry) and against the Triton
:func:`~gdn_core.ops.wy.wy_apply` on the same inverse; bitwise repeatable; a strided
``v`` view giving the same bits; each document's bits the same when it is launched
alone; a non-finite value in one document's rows (the rows a short chunk before it reads
through TMA, in K, V, β, G and ``A_inv``) leaving the other documents' bits unchanged;
and on :func:`~gdn_core.ops.gluon.wy.wy_fwd_gluon`'s inverse, within rounding of that
kernel's own W, U.
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
LENGTHS = [5, 64, 70, 1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 200]
# 32K tokens: one document, and 9 documents with short last chunks (sum 32768)
LONG = [32768], [1, 4095, 63, 8191, 65, 10000, 3000, 7000, 353]


def _problem(lengths, H, group, dtype, seed=0):
    """Inputs of the stage and the inverse the backward reads (the Triton ``wy_fwd``'s,
    through ``inverse_for_backward``: in ``dtype``)."""
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.gluon import available
    from gdn_core.ops.wy import inverse_for_backward, wy_fwd

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
    A32 = wy_fwd(k, v, beta, G, index, group)[0]
    A_inv = inverse_for_backward(A32, k, v)
    assert A_inv.dtype == dtype
    return offs, index, (k, v, beta, G, A_inv), A32


def _expand(x, group):
    return x.float().repeat_interleave(group, dim=1)


@pytest.mark.parametrize("config", [(4, None), (8, None), (4, 96)],
                         ids=["w4", "w8", "w4-maxnreg96"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, *LONG], ids=["short", "32k-1doc", "32k-9docs"])
def test_gluon_wy_apply_matches_reference_triton_and_repeats(lengths, group, dtype, config,
                                                             monkeypatch):
    from gdn_core.ops.gluon import wy as gw
    from gdn_core.ops.wy import wy_apply

    monkeypatch.setattr(gw, "GLUON_WY_APPLY_WARPS", config[0])
    monkeypatch.setattr(gw, "GLUON_WY_APPLY_MAXNREG", config[1])
    H = 2 if len(lengths) == len(LENGTHS) else 8
    offs, index, (k, v, beta, G, A_inv), A32 = _problem(lengths, H, group, dtype)
    W, U = gw.wy_apply_gluon(k, v, beta, G, A_inv, index, group)
    assert W.dtype == dtype and W.shape == (*v.shape[:2], 128)
    assert U.dtype == dtype and U.shape == v.shape
    W2, U2 = gw.wy_apply_gluon(k, v, beta, G, A_inv, index, group)
    assert torch.equal(W2, W) and torch.equal(U2, U)
    bounds = list(zip(offs[:-1], offs[1:]))
    _, W_ref, U_ref = R.wy_ref(_expand(k, group), v.float(), beta.float(), G, bounds)
    assert max_rel_err(W, W_ref) <= TOL[dtype]
    assert max_rel_err(U, U_ref) <= TOL[dtype]
    W_tr, U_tr = wy_apply(k, v, beta, G, A_inv, index, group)
    assert max_rel_err(W, W_tr) <= TOL[dtype] and max_rel_err(U, U_tr) <= TOL[dtype]
    # the fp32 inverse is rounded on the host as the Triton kernel rounds it: the same bits
    W3, U3 = gw.wy_apply_gluon(k, v, beta, G, A32, index, group)
    assert torch.equal(W3, W) and torch.equal(U3, U)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_wy_apply_reads_strided_v_in_place(dtype):
    """``v`` as a view of a wider projection (the layer's packed q/k/v): the same bits; a
    ``v`` with a head stride of its own (copied) too."""
    from gdn_core.ops.gluon.wy import wy_apply_gluon

    group = 2
    offs, index, (k, v, beta, G, A_inv), _ = _problem(LENGTHS, 2, group, dtype, seed=2)
    T, HV, V = v.shape
    proj = torch.cat([torch.zeros(T, 3 * V, dtype=dtype, device="cuda"), v.reshape(T, HV * V)],
                     -1)
    view = proj[:, 3 * V:].view(T, HV, V)
    assert not view.is_contiguous()
    want = wy_apply_gluon(k, v, beta, G, A_inv, index, group)
    got = wy_apply_gluon(k, view, beta, G, A_inv, index, group)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    spread = torch.cat([v, v], -1)[..., :V]
    got = wy_apply_gluon(k, spread, beta, G, A_inv, index, group)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_wy_apply_documents_are_independent(dtype):
    """Each document alone gives the packed launch's bits; NaN/inf in a document's first
    row (which the short chunk before it loads past its end: K, V, β, G, A_inv) stays in
    that document."""
    from gdn_core.ops.gluon.wy import wy_apply_gluon

    group = 2
    lengths = [5, 64, 70, 33, 200]
    offs, index, args, _ = _problem(lengths, 2, group, dtype, seed=1)
    out = wy_apply_gluon(*args, index, group)
    for d, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        got = wy_apply_gluon(*(x[bos:eos] for x in args), one, group)
        for name, a, b in zip(("W", "U"), got, out):
            assert torch.equal(a, b[bos:eos]), f"document {d}: {name}"

    for d in (1, 3):
        row = offs[d]
        bad = [x.clone() for x in args]
        for x, val in zip(bad, ("nan", "inf", "nan", "nan", "nan")):
            x[row] = float(val)
        got = wy_apply_gluon(*bad, index, group)
        for a, b in zip(got, out):
            assert torch.equal(a[:offs[d]], b[:offs[d]]), f"NaN in document {d} leaked backwards"
            assert torch.equal(a[offs[d + 1]:], b[offs[d + 1]:])


@pytest.mark.parametrize("group", [1, 2])
def test_gluon_wy_apply_on_the_gluon_forward_s_inverse(group):
    """The backward's recompute from :func:`wy_fwd_gluon`'s inverse (16-bit, as the
    backward saves it): W, U within rounding of that kernel's own (its products take the
    same 16-bit A_inv operand, so they should in fact agree bitwise: reported, not
    required) and of the Triton ``wy_apply`` on the same inverse."""
    from gdn_core.ops.gluon.wy import wy_apply_gluon, wy_fwd_gluon
    from gdn_core.ops.wy import inverse_for_backward, wy_apply

    dtype = torch.bfloat16
    offs, index, (k, v, beta, G, _), _ = _problem(LENGTHS, 2, group, dtype, seed=3)
    A32, W, U = wy_fwd_gluon(k, v, beta, G, index, group)
    A_inv = inverse_for_backward(A32, k, v)
    W2, U2 = wy_apply_gluon(k, v, beta, G, A_inv, index, group)
    assert max_rel_err(W2, W.float()) <= TOL[dtype] and max_rel_err(U2, U.float()) <= TOL[dtype]
    W3, U3 = wy_apply(k, v, beta, G, A_inv, index, group)
    assert max_rel_err(W2, W3.float()) <= TOL[dtype] and max_rel_err(U2, U3.float()) <= TOL[dtype]
    print(f"wy_apply_gluon == wy_fwd_gluon's W, U bitwise: "
          f"{torch.equal(W2, W) and torch.equal(U2, U)}")


def test_gluon_wy_apply_empty_and_tiny():
    """No chunks (T = 0) and a one-token document: no launch / one short chunk."""
    from gdn_core.ops.gluon.wy import wy_apply_gluon
    from gdn_core.ops.wy import wy_apply

    offs, index, args, _ = _problem([1], 1, 1, torch.bfloat16, seed=5)
    W, U = wy_apply_gluon(*args, index, 1)
    W_tr, U_tr = wy_apply(*args, index, 1)
    assert max_rel_err(W, W_tr) <= TOL[torch.bfloat16]
    assert max_rel_err(U, U_tr) <= TOL[torch.bfloat16]
    empty = ChunkIndex.build([0], "cuda")
    z = [x[:0] for x in args]
    W0, U0 = wy_apply_gluon(*z, empty, 1)
    assert W0.shape == (0, 1, 128) and U0.shape == (0, 1, 128)
