"""Forward Triton kernels against the fp32 reference, stage by stage and composed.

Runs under the Triton interpreter on CPU (``conftest.py``), so only fp32 and
fp16 are exercised here (``tl.dot`` on bf16 is wrong in the interpreter);
bf16 is validated on the GPU.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex, host_offsets
from gdn_core.ops import (
    chunk_cumsum_fwd,
    chunk_cumsum_rev,
    chunk_output_fwd,
    chunk_state_fwd,
    gdn_forward_triton,
    inverse_for_backward,
    l2norm_bwd,
    l2norm_bwd_pair,
    l2norm_fwd,
    l2norm_fwd_pair,
    record_launches,
    registered_launchers,
    wy_apply,
    wy_fwd,
)
from gdn_core.ops.chunk_state import chunk_state_outputs_fwd

# document lengths: empty, single token, one short of / exactly / one past a
# chunk, and a ~150-token document spanning three chunks.
VARLEN = [0, 1, 63, 64, 65, 150]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
# (H, HV, K, V): grouped heads, K/V with a non-power-of-two 48
DIMS = [(1, 2, 48, 32), (2, 2, 16, 48)]


def _offsets(lengths):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return offs


def _bounds(offs):
    return list(zip(offs[:-1], offs[1:]))


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all()
    if expected.numel() == 0:
        return 0.0
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _check(name, actual, expected, tol):
    err = _rel_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def _inputs(lengths, H, HV, K, V, dtype, seed=0, l2=True):
    gen = torch.Generator().manual_seed(seed)
    offs = _offsets(lengths)
    T = offs[-1]
    q = torch.randn(T, H, K, generator=gen)
    k = torch.randn(T, H, K, generator=gen)
    if l2:  # the kernels' stage inputs are normalised keys in practice
        q, k = R.l2_normalize(q), R.l2_normalize(k)
    v = torch.randn(T, HV, V, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * 0.3 - 0.01
    beta = torch.rand(T, HV, generator=gen) * 0.9 + 0.05
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return offs, q, k, v, g, beta


def _expand(x, group):
    return x.float().repeat_interleave(group, dim=1)


# ---------------------------------------------------------------- cumsum ---


@pytest.mark.parametrize("HV", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_cumsum(HV, dtype):
    offs = _offsets(VARLEN)
    index = ChunkIndex.build(offs, "cpu")
    gen = torch.Generator().manual_seed(1)
    g = (-torch.rand(offs[-1], HV, generator=gen)).to(dtype)
    G = chunk_cumsum_fwd(g, index)
    assert G.dtype == torch.float32
    G_ref = R.chunk_cumsum_ref(g.float(), _bounds(offs))
    _check("G", G, G_ref, 1e-6)

    # the reverse cumsum is the backward of the forward one
    dG = torch.randn(offs[-1], HV, generator=gen).to(dtype)
    g_leaf = g.float().requires_grad_()
    R.chunk_cumsum_ref(g_leaf, _bounds(offs)).backward(dG.float())
    dg = chunk_cumsum_rev(dG, index)
    assert dg.dtype == torch.float32
    _check("dg", dg, g_leaf.grad, 1e-6)


def test_chunk_cumsum_reads_minus_inf_as_the_floor():
    """``g = -inf`` (a full reset) reads as ``MIN_LOG_DECAY`` in the kernel and the
    reference alike (no ``-inf - -inf`` NaN downstream); NaN stays NaN; the reverse
    cumsum (a gradient) is not clamped."""
    from gdn_core.chunking import MIN_LOG_DECAY

    index = ChunkIndex.build([0, 5, 70], "cpu")
    g = -torch.rand(70, 2, generator=torch.Generator().manual_seed(2))
    g[3, 0], g[10, 1], g[11, 1], g[40, 0] = float("-inf"), float("-inf"), -500.0, float("nan")
    G, G_ref = chunk_cumsum_fwd(g, index), R.chunk_cumsum_ref(g, _bounds([0, 5, 70]))
    floor = g.clamp_min(MIN_LOG_DECAY)
    assert torch.isfinite(G[:40]).all() and torch.isnan(G[40:64, 0]).all()
    torch.testing.assert_close(G, G_ref, equal_nan=True, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(G[:5], floor[:5].cumsum(0))
    big = torch.full((70, 2), -1e4)
    assert torch.equal(chunk_cumsum_rev(big, index)[5], big[5:69].sum(0))


# ---------------------------------------------------------------- l2norm ---


@pytest.mark.parametrize("D", [16, 48, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_l2norm(D, dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(37, 3, D, generator=gen) * 2).to(dtype)
    dy = torch.randn(37, 3, D, generator=gen).to(dtype)
    y, rstd = l2norm_fwd(x)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (37, 3)
    xr = x.float().requires_grad_()
    y_ref = R.l2_normalize(xr)
    y_ref.backward(dy.float())
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    _check("y", y, y_ref.detach(), tol)
    _check("rstd", rstd, torch.rsqrt((x.float() ** 2).sum(-1) + 1e-6), 1e-6)
    dx = l2norm_bwd(y, rstd, dy)
    assert dx.dtype == dtype
    _check("dx", dx, xr.grad, 4 * tol)


def test_l2norm_reads_a_projection_view_in_place():
    """q as a model passes it (heads of a wider projection's columns): the same bits as
    from a contiguous copy, and a contiguous result."""
    gen = torch.Generator().manual_seed(4)
    proj = torch.randn(37, 3 * 48 + 16, generator=gen).to(torch.bfloat16)
    view = proj[:, 16:].view(37, 3, 48)
    assert not view.is_contiguous()
    y, rstd = l2norm_fwd(view)
    y2, rstd2 = l2norm_fwd(view.contiguous())
    assert y.is_contiguous() and torch.equal(y, y2) and torch.equal(rstd, rstd2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_l2norm_pairs_give_the_single_launches_bits(dtype):
    """q and k in one launch (forward and backward): bitwise each one's own launch, for
    views of a packed projection too; one launch each (two on shapes that differ)."""
    gen = torch.Generator().manual_seed(5)
    proj = torch.randn(41, 2, 3, 32, generator=gen).to(dtype)
    q, k = proj[:, 0], proj[:, 1]  # [41, 3, 32] views, strides of the projection
    dq, dk = (torch.randn(41, 3, 32, generator=gen) for _ in range(2))
    with record_launches() as launches:
        (yq, rq), (yk, rk) = l2norm_fwd_pair(q, k)
        dxq, dxk = l2norm_bwd_pair((yq, rq, dq, torch.empty_like(q)),
                                   (yk, rk, dk, torch.empty_like(k)))
    assert [launch.name.rsplit(".", 1)[-1] for launch in launches] == [
        "l2norm_fwd_pair", "l2norm_bwd_pair"]
    for x, y, r, dy, dx in ((q, yq, rq, dq, dxq), (k, yk, rk, dk, dxk)):
        y1, r1 = l2norm_fwd(x)
        assert torch.equal(y, y1) and torch.equal(r, r1)
        assert torch.equal(dx, l2norm_bwd(y1, r1, dy, out=torch.empty_like(x)))
    # of two shapes: each its own launch, the same results
    (ya, _), (yb, _) = l2norm_fwd_pair(q, k[:7])
    assert torch.equal(ya, yq) and torch.equal(yb, yk[:7])
    dxa, dxb = l2norm_bwd_pair((yq, rq, dq, None), (yk[:7], rk[:7], dk[:7], None))
    assert torch.equal(dxa, l2norm_bwd(yq, rq, dq))
    assert torch.equal(dxb, l2norm_bwd(yk[:7], rk[:7], dk[:7]))


def test_l2norm_empty():
    y, rstd = l2norm_fwd(torch.zeros(0, 2, 32))
    assert y.shape == (0, 2, 32) and rstd.shape == (0, 2)
    assert l2norm_bwd(y, rstd, y).shape == (0, 2, 32)


# -------------------------------------------------------------------- WY ---


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wy(dims, dtype):
    H, HV, K, V = dims
    group = HV // H
    offs, _, k, v, g, beta = _inputs(VARLEN, H, HV, K, V, dtype, seed=3)
    index = ChunkIndex.build(offs, "cpu")
    bounds = _bounds(offs)
    G = R.chunk_cumsum_ref(g, bounds)
    A_inv, W, U = wy_fwd(k, v, beta, G, index, group)
    A_ref, W_ref, U_ref = R.wy_ref(_expand(k, group), v.float(), beta.float(), G, bounds)
    assert A_inv.dtype == torch.float32 and W.dtype == dtype and U.dtype == dtype
    # A_inv is computed in fp32 from the (rounded) inputs: tight in both dtypes
    _check("A_inv", A_inv, A_ref, 1e-5)
    _check("W", W, W_ref, TOL[dtype])
    _check("U", U, U_ref, TOL[dtype])
    # the backward's W, U from the stored inverse: the same bits
    W2, U2 = wy_apply(k, v, beta, G, A_inv, index, group)
    assert torch.equal(W2, W) and torch.equal(U2, U)
    # v as a view of a wider projection (token and head strides of its own): read in place
    wide = torch.cat([v, torch.zeros_like(v)], -1)[..., :V]
    assert not wide.is_contiguous()
    _, W3, U3 = wy_fwd(k, wide, beta, G, index, group)
    W4, U4 = wy_apply(k, wide, beta, G, A_inv, index, group)
    assert all(torch.equal(a, W) for a in (W3, W4)) and all(torch.equal(a, U) for a in (U3, U4))
    # columns past each chunk's length are exactly zero
    for bos, eos in bounds:
        for start in range(bos, eos, 64):
            n = min(64, eos - start)
            assert (A_inv[start : start + n, :, n:] == 0).all()


def test_wy_partial_chunks_every_block_edge():
    """Chunk lengths on and around each 16-row block edge (the block stacks mask
    their shifted rows by the chunk length), against the fp32 reference."""
    lengths = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63]
    offs, _, k, v, g, beta = _inputs(lengths, 1, 2, 32, 16, torch.float32, seed=5)
    index = ChunkIndex.build(offs, "cpu")
    bounds = _bounds(offs)
    G = R.chunk_cumsum_ref(g, bounds)
    A_inv, W, U = wy_fwd(k, v, beta, G, index, 2)
    A_ref, W_ref, U_ref = R.wy_ref(_expand(k, 2), v.float(), beta.float(), G, bounds)
    _check("A_inv", A_inv, A_ref, 1e-5)
    _check("W", W, W_ref, 1e-4)
    _check("U", U, U_ref, 1e-4)
    for bos, eos in bounds:
        assert (A_inv[bos:eos, :, eos - bos :] == 0).all()


def test_wy_strong_coupling():
    """Nearly parallel keys with β ≈ 1: large inverse entries, still accurate."""
    offs = [0, 64]
    index = ChunkIndex.build(offs, "cpu")
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(1, 1, 32, generator=gen)
    k = R.l2_normalize(base + 0.05 * torch.randn(64, 1, 32, generator=gen))
    v = torch.randn(64, 1, 16, generator=gen)
    beta = torch.full((64, 1), 0.99)
    G = torch.zeros(64, 1)
    A_inv, W, U = wy_fwd(k, v, beta, G, index, 1)
    A_ref, W_ref, U_ref = R.wy_ref(k, v, beta, G, _bounds(offs))
    _check("A_inv", A_inv, A_ref, 1e-4)
    _check("W", W, W_ref, 1e-4)
    _check("U", U, U_ref, 1e-4)
    # the forward pass skips A_inv but gets the same W and U
    none, W2, U2 = wy_fwd(k, v, beta, G, index, 1, output_A_inv=False)
    assert none is None and torch.equal(W2, W) and torch.equal(U2, U)


def test_wy_apply_rejects_a_wrong_inverse():
    offs = [0, 70]
    index = ChunkIndex.build(offs, "cpu")
    k, v = torch.randn(70, 1, 32), torch.randn(70, 2, 16)
    beta, G = torch.rand(70, 2), torch.zeros(70, 2)
    with pytest.raises(ValueError, match=r"A_inv must be \[T, HV, 64\]"):
        wy_apply(k, v, beta, G, torch.zeros(70, 2, 32), index, 2)
    with pytest.raises(ValueError, match=r"in torch.float32, got .* torch.float16"):
        wy_apply(k, v, beta, G, torch.zeros(70, 2, 64, dtype=torch.float16), index, 2)
    # 16-bit inputs: the inverse may come in their dtype (what the backward saves), not another
    k16, v16 = k.half(), v.half()
    wy_apply(k16, v16, beta, G, torch.zeros(70, 2, 64, dtype=torch.float16), index, 2)
    with pytest.raises(ValueError, match=r"float32 or torch.float16, got .* torch.bfloat16"):
        wy_apply(k16, v16, beta, G, torch.zeros(70, 2, 64, dtype=torch.bfloat16), index, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_inverse_for_backward_gives_the_recomputed_bits(dtype):
    """W, U from the saved inverse (16-bit for 16-bit inputs) equal the forward's."""
    offs, _, k, v, g, beta = _inputs(VARLEN, 1, 2, 32, 16, dtype, seed=6)
    index = ChunkIndex.build(offs, "cpu")
    G = R.chunk_cumsum_ref(g, _bounds(offs))
    A_inv, W, U = wy_fwd(k, v, beta, G, index, 2)
    saved = inverse_for_backward(A_inv, k, v)
    assert saved.dtype == dtype and (saved is A_inv) == (dtype == torch.float32)
    W2, U2 = wy_apply(k, v, beta, G, saved, index, 2)
    assert torch.equal(W2, W) and torch.equal(U2, U)


# ----------------------------------------------------------- chunk state ---


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_state(dims, dtype):
    H, HV, K, V = dims
    group = HV // H
    offs, _, k, v, g, beta = _inputs(VARLEN, H, HV, K, V, dtype, seed=5)
    index = ChunkIndex.build(offs, "cpu")
    bounds = _bounds(offs)
    N = len(bounds)
    G = R.chunk_cumsum_ref(g, bounds)
    ke = _expand(k, group)
    _, W_ref, U_ref = R.wy_ref(ke, v.float(), beta.float(), G, bounds)
    W, U = W_ref.to(dtype), U_ref.to(dtype)
    h0 = torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(6))
    h, v_new, final = chunk_state_fwd(k, W, U, G, index, group, h0, output_final_state=True)
    h_ref, vn_ref, final_ref = R.chunk_states_ref(ke, W.float(), U.float(), G, bounds, h0)
    assert h.dtype == dtype and v_new.dtype == dtype and final.dtype == torch.float32
    assert h.shape == (index.num_chunks, HV, K, V)
    _check("h", h, h_ref, TOL[dtype])
    _check("v_new", v_new, vn_ref, TOL[dtype])
    _check("final", final, final_ref, TOL[dtype])
    # the empty document passes its initial state through unchanged
    assert torch.equal(final[0], h0[0])

    # without an initial state; states and final state optional
    h2, vn2, f2 = chunk_state_fwd(
        k, W, U, G, index, group, None, output_final_state=False, store_states=False
    )
    assert h2 is None and f2 is None
    _, vn2_ref, _ = R.chunk_states_ref(ke, W.float(), U.float(), G, bounds, None)
    _check("v_new (h0=None)", vn2, vn2_ref, TOL[dtype])


def test_chunk_state_transition_matrix():
    """U = 0 [T,HV,K] and S_0 = I give the chunk transition M (value width from U)."""
    H, HV, K, V = 1, 2, 32, 16
    lengths = [130, 0, 40]
    offs, _, k, v, g, beta = _inputs(lengths, H, HV, K, V, torch.float32, seed=7)
    index = ChunkIndex.build(offs, "cpu")
    bounds = _bounds(offs)
    G = R.chunk_cumsum_ref(g, bounds)
    ke = _expand(k, 2)
    _, W, _ = R.wy_ref(ke, v, beta, G, bounds)
    U = torch.zeros(offs[-1], HV, K)
    eye = torch.eye(K).expand(len(lengths), HV, K, K).contiguous()
    h, v_new, M = chunk_state_fwd(k, W, U, G, index, 2, eye, output_final_state=True)
    assert h.shape == (index.num_chunks, HV, K, K) and v_new.shape == (offs[-1], HV, K)
    _, _, M_ref = R.chunk_states_ref(ke, W, U, G, bounds, eye)
    _check("M", M, M_ref, 1e-5)
    # M of a one-chunk document in closed form: exp(G_last) I − (K ⊙ exp(G_last − G))ᵀ W
    bos, eos = bounds[2]
    Gd = G[bos:eos]
    kd = ke[bos:eos] * (Gd[-1] - Gd).exp()[..., None]
    closed = Gd[-1].exp()[:, None, None] * torch.eye(K) - torch.einsum(
        "thk,thj->hkj", kd, W[bos:eos]
    )
    _check("M closed form", M[2], closed, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_state_writes_the_outputs_and_the_entry_state_queries(dtype):
    """``chunk_state_outputs_fwd``: the state walk writes each chunk's outputs: from ``h0``, the
    outputs of the chunked reference; of a summary ``[E | M]`` (zero and identity entry),
    the zero-entry outputs ``o⁰`` and the entry-state queries ``q̃``, so that
    ``o⁰ + q̃ S_in`` is the output from ``S_in`` (docs/exact_split.md)."""
    H, HV, K, V = 1, 2, 32, 16
    group, scale = 2, 0.3
    offs, q, k, v, g, beta = _inputs([150, 0, 1, 64, 70], H, HV, K, V, dtype, seed=11)
    index = ChunkIndex.build(offs, "cpu")
    bounds = _bounds(offs)
    N, T = len(bounds), offs[-1]
    G = R.chunk_cumsum_ref(g, bounds)
    qe, ke = _expand(q, group), _expand(k, group)
    _, W_ref, U_ref = R.wy_ref(ke, v.float(), beta.float(), G, bounds)
    W, U = W_ref.to(dtype), U_ref.to(dtype)
    h0 = torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(12)) * 0.2

    out = torch.full((T, HV, V), float("nan"))
    chunk_state_outputs_fwd(k, W, U, G, index, group, q, out, scale, h0)
    h_ref, vn_ref, _ = R.chunk_states_ref(ke, W.float(), U.float(), G, bounds, h0)
    o_ref = R.chunk_output_ref(qe, ke, vn_ref, h_ref, G, scale, bounds)
    _check("o from h0", out, o_ref, TOL[dtype])

    summ = torch.full((T, HV, V + K), float("nan"))
    chunk_state_outputs_fwd(k, W, U, G, index, group, q, summ, scale, state_width=V + K,
                            identity_state=True)
    qt_ref = R.entry_state_queries_ref(qe, ke, W.float(), G, scale, bounds)
    _check("q~", summ[..., V:], qt_ref, TOL[dtype])
    h_0, vn_0, _ = R.chunk_states_ref(ke, W.float(), U.float(), G, bounds, None)
    _check("o0", summ[..., :V], R.chunk_output_ref(qe, ke, vn_0, h_0, G, scale, bounds),
           TOL[dtype])
    with_entry = torch.cat([summ[b:e, :, :V] + torch.einsum("thk,hkv->thv", summ[b:e, :, V:],
                                                           h0[n])
                            for n, (b, e) in enumerate(bounds)])
    _check("o0 + q~ S_in", with_entry, o_ref, TOL[dtype])


def test_chunk_state_outputs_refuse_bad_arguments():
    offs, q, k, v, g, beta = _inputs([70], 1, 1, 16, 16, torch.float32, seed=13)
    index = ChunkIndex.build(offs, "cpu")
    T = offs[-1]
    W, U, G = torch.zeros(T, 1, 16), torch.zeros(T, 1, 16), torch.zeros(T, 1)
    with pytest.raises(ValueError, match="q must be"):
        chunk_state_outputs_fwd(k, W, U, G, index, 1, q[:-1], torch.zeros(T, 1, 16), 1.0)
    with pytest.raises(ValueError, match="out must be"):
        chunk_state_outputs_fwd(k, W, U, G, index, 1, q, torch.zeros(T, 1, 16).half(), 1.0)


# ---------------------------------------------------------------- output ---


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_output(dims, dtype):
    H, HV, K, V = dims
    group = HV // H
    offs, q, k, v, g, beta = _inputs(VARLEN, H, HV, K, V, dtype, seed=8)
    index = ChunkIndex.build(offs, "cpu")
    bounds = _bounds(offs)
    G = R.chunk_cumsum_ref(g, bounds)
    ke, qe = _expand(k, group), _expand(q, group)
    _, W, U = R.wy_ref(ke, v.float(), beta.float(), G, bounds)
    h0 = torch.randn(len(bounds), HV, K, V, generator=torch.Generator().manual_seed(9))
    h, v_new, _ = R.chunk_states_ref(ke, W, U, G, bounds, h0)
    h, v_new = h.to(dtype), v_new.to(dtype)
    o = chunk_output_fwd(q, k, v_new, h, G, 0.37, index, group)
    o_ref = R.chunk_output_ref(qe, ke, v_new.float(), h.float(), G, 0.37, bounds)
    assert o.dtype == dtype
    _check("o", o, o_ref, TOL[dtype])


def test_chunk_output_no_overflow():
    """Strong decay: exp(G_i − G_j) for i < j would overflow; it must never be formed."""
    offs = [0, 100]
    index = ChunkIndex.build(offs, "cpu")
    _, q, k, v, _, _ = _inputs([100], 1, 1, 16, 16, torch.float32, seed=10)
    g = torch.full((100, 1), -30.0)  # G reaches -1920 within a chunk
    G = R.chunk_cumsum_ref(g, _bounds(offs))
    h = torch.randn(2, 1, 16, 16)
    v_new = torch.randn(100, 1, 16)
    o = chunk_output_fwd(q, k, v_new, h, G, 1.0, index, 1)
    o_ref = R.chunk_output_ref(q, k, v_new, h, G, 1.0, _bounds(offs))
    _check("o", o, o_ref, 1e-5)


# ------------------------------------------------------- composed forward ---


@pytest.mark.parametrize(
    "lengths, dims, l2, use_h0, scale",
    [
        (VARLEN, (1, 2, 48, 32), True, True, 0.3),
        (VARLEN, (2, 2, 16, 48), False, False, None),
        ([1, 0, 65], (2, 4, 32, 16), True, True, None),  # hv // group, not hv % H
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_vs_naive(lengths, dims, l2, use_h0, scale, dtype):
    H, HV, K, V = dims
    offs, q, k, v, g, beta = _inputs(lengths, H, HV, K, V, dtype, seed=11, l2=False)
    if not l2:  # unnormalised keys would make the recurrence blow up
        q, k = R.l2_normalize(q.float()).to(dtype), R.l2_normalize(k.float()).to(dtype)
    index = ChunkIndex.build(offs, "cpu")
    N = len(offs) - 1
    h0 = torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(12)) if use_h0 else None
    out = gdn_forward_triton(
        q, k, v, g, beta, scale=scale, index=index, initial_state=h0,
        output_final_state=True, use_qk_l2norm_in_kernel=l2,
    )
    o_ref, f_ref = R.naive_recurrent_gdn(
        q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=h0,
        output_final_state=True, cu_seqlens=torch.tensor(offs), use_qk_l2norm_in_kernel=l2,
    )
    assert out.o.dtype == dtype and out.o.shape == (offs[-1], HV, V)
    assert out.final_state.dtype == torch.float32 and out.final_state.shape == (N, HV, K, V)
    _check("o", out.o, o_ref[0], TOL[dtype])
    _check("final", out.final_state, f_ref, TOL[dtype])
    _check("G", out.G, R.chunk_cumsum_ref(g, _bounds(offs)), 1e-6)
    if l2:
        assert out.q_rstd.shape == (offs[-1], H) and out.k_rstd.shape == (offs[-1], H)
        _check("q_used", out.q_used, R.l2_normalize(q.float()), TOL[dtype])
        _check("k_used", out.k_used, R.l2_normalize(k.float()), TOL[dtype])
    else:
        assert out.q_used is q and out.k_used is k
        assert out.q_rstd is None and out.k_rstd is None


def test_forward_fixed_batch():
    """A [B, T] batch viewed flat: B documents of T tokens."""
    B, T, H, HV, K, V = 2, 70, 1, 1, 16, 16
    offs, q, k, v, g, beta = _inputs([T] * B, H, HV, K, V, torch.float32, seed=13)
    index = ChunkIndex.build(host_offsets(None, B, T), "cpu")
    out = gdn_forward_triton(
        q, k, v, g, beta, scale=None, index=index, initial_state=None,
        output_final_state=False, use_qk_l2norm_in_kernel=False,
    )
    assert out.final_state is None
    o_ref, _ = R.naive_recurrent_gdn(
        *(x.reshape(B, T, *x.shape[1:]) for x in (q, k, v, g, beta))
    )
    _check("o", out.o, o_ref.reshape(B * T, HV, V), 1e-4)


@pytest.mark.parametrize("lengths", [[0], [0, 0]])
def test_forward_empty(lengths):
    """T == 0: nothing is launched; final states are the initial states (or zeros)."""
    H, HV, K, V = 1, 2, 16, 32
    offs, q, k, v, g, beta = _inputs(lengths, H, HV, K, V, torch.float32)
    index = ChunkIndex.build(offs, "cpu")
    N = len(lengths)
    h0 = torch.randn(N, HV, K, V)
    for init in (h0, None):
        out = gdn_forward_triton(
            q, k, v, g, beta, scale=None, index=index, initial_state=init,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        assert out.o.shape == (0, HV, V) and out.G.shape == (0, HV)
        assert torch.equal(out.final_state, init if init is not None else torch.zeros_like(h0))


def test_forward_deterministic_and_no_atomics():
    offs, q, k, v, g, beta = _inputs([5, 70], 1, 2, 16, 16, torch.float32, seed=14)
    index = ChunkIndex.build(offs, "cpu")
    kwargs = dict(
        scale=None, index=index, initial_state=None, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    with record_launches() as launches:
        a = gdn_forward_triton(q, k, v, g, beta, **kwargs)
    b = gdn_forward_triton(q, k, v, g, beta, **kwargs)
    assert torch.equal(a.o, b.o) and torch.equal(a.final_state, b.final_state)
    names = {launch.name.rsplit(".", 1)[-1] for launch in launches}
    # q and k are normalised in one launch
    assert {"l2norm_fwd_pair", "chunk_cumsum_fwd", "wy_fwd", "chunk_state_fwd"} <= names
    assert "chunk_output_fwd" in names
    assert not [launch for launch in launches if launch.uses_atomics]
    # declarations match the kernel sources
    forward_modules = ("cumsum", "l2norm", "wy", "chunk_state", "output")
    for name, info in registered_launchers().items():
        if name.split(".")[-2] not in forward_modules:
            continue
        assert not info.uses_atomics and info.kernels, name
        for kernel in info.kernels:
            assert "atomic_" not in inspect.getsource(kernel.fn), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wy_fwd_writes_the_inverse_for_backward_itself(dtype):
    """``A_inv_for_backward=True``: the kernel stores the inverse as the backward reads it
    (16-bit inputs: rounded to their dtype in the kernel), the bits of
    ``inverse_for_backward`` of the fp32 one, and the same W, U."""
    offs, _, k, v, g, beta = _inputs(VARLEN, 1, 2, 32, 16, dtype, seed=7)
    index = ChunkIndex.build(offs, "cpu")
    G = R.chunk_cumsum_ref(g, _bounds(offs))
    A_inv, W, U = wy_fwd(k, v, beta, G, index, 2)
    saved, W2, U2 = wy_fwd(k, v, beta, G, index, 2, A_inv_for_backward=True)
    want = inverse_for_backward(A_inv, k, v)
    assert saved.dtype == want.dtype == dtype
    assert torch.equal(saved, want) and torch.equal(W2, W) and torch.equal(U2, U)
