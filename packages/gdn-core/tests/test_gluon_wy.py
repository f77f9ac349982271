"""The Gluon WY launcher without a GPU: it imports, it is declared atomic-free, it refuses
what it does not serve (``ValueError``) and devices it cannot run on (``RuntimeError``)
before compiling anything, it reads a packed-head ``v`` view in place; and the kernel's
dataflow (block substitution on the stacked transposed diagonal blocks, the FMA merges,
rows past a short chunk holding the next document's values), emulated in fp64, against
the reference. The kernel itself: ``*_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops.gluon import wy as gw
from gdn_core.ops.gluon.tma import rows_view


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, v_dtype=None):
    index = ChunkIndex.build([0, T], "cpu")
    HV = H * group
    return (torch.zeros(T, H, K, dtype=dtype), torch.zeros(T, HV, V, dtype=v_dtype or dtype),
            torch.zeros(T, HV, dtype=dtype), torch.zeros(T, HV), index, group)


def test_declared_atomic_free():
    info = gw.wy_fwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (gw._wy_fwd_gluon_kernel,)


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(v_dtype=torch.float16)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not gw.gluon_wy_supported(args[0], args[1], args[4])
    with pytest.raises(ValueError):
        gw.wy_fwd_gluon(*args)


def test_register_inverse_keeps_the_triton_kernel(monkeypatch):
    """``GDN_CORE_WY_INV=reg`` is a variant of the Triton kernel: asked for, the Gluon WY
    (a default stage) does not serve the call, so the variant runs; a path of no known
    name raises instead of being ignored."""
    from gdn_core.switches import WY_INV_ENV

    k, v, _, _, index, _ = _args()
    monkeypatch.delenv(WY_INV_ENV, raising=False)
    assert gw.gluon_wy_supported(k, v, index)
    monkeypatch.setenv(WY_INV_ENV, "subst")
    assert gw.gluon_wy_supported(k, v, index)
    monkeypatch.setenv(WY_INV_ENV, "reg")
    assert not gw.gluon_wy_supported(k, v, index)
    monkeypatch.setenv(WY_INV_ENV, "fast")
    with pytest.raises(ValueError):
        gw.gluon_wy_supported(k, v, index)


def test_other_chunk_size_raises_value_error():
    k, v, beta, G, _, group = _args()
    index = ChunkIndex.build([0, 70], "cpu", chunk_size=32)
    assert not gw.gluon_wy_supported(k, v, index)
    with pytest.raises(ValueError, match="chunks of 64"):
        gw.wy_fwd_gluon(k, v, beta, G, index, group)


def test_mismatched_shapes_raise_value_error():
    k, v, beta, G, index, group = _args()
    with pytest.raises(ValueError, match="shape mismatch"):
        gw.wy_fwd_gluon(k, v, beta[:-1], G, index, group)
    with pytest.raises(ValueError, match="shape mismatch"):
        gw.wy_fwd_gluon(k, v, beta, G, index, group + 1)
    with pytest.raises(ValueError, match="shape mismatch"):
        gw.wy_fwd_gluon(k[:-1], v[:-1], beta[:-1], G[:-1], index, group)


def test_cpu_tensors_raise_runtime_error():
    args = _args()
    assert gw.gluon_wy_supported(args[0], args[1], args[4])
    with pytest.raises(RuntimeError):
        gw.wy_fwd_gluon(*args)


def test_rows_view_reads_packed_head_views_in_place():
    """A ``v`` view of a wider projection (heads packed, 16-byte row stride) is tiled in
    place; one with a head stride of its own, or an odd row stride, is copied."""
    T, HV, V = 9, 2, 128
    proj = torch.randn(T, 3 * HV * V, dtype=torch.bfloat16)
    view = proj[:, HV * V:2 * HV * V].view(T, HV, V)
    assert not view.is_contiguous()
    rows = rows_view(view)
    assert rows.data_ptr() == view.data_ptr() and rows.stride() == (3 * HV * V, 1)
    assert torch.equal(rows, view.reshape(T, HV * V))
    spread = torch.randn(T, HV, 2 * V, dtype=torch.bfloat16)[..., :V]  # head stride 2V
    rows = rows_view(spread)
    assert rows.is_contiguous() and torch.equal(rows, spread.reshape(T, HV * V))
    odd = torch.randn(T, HV * V + 1, dtype=torch.bfloat16)[:, 1:].view(T, HV, V)
    rows = rows_view(odd)
    assert rows.is_contiguous() and torch.equal(rows, odd.reshape(T, HV * V))


# ------------------------------------------------- the kernel's dataflow, emulated


def _emulate(k, v, beta, G, index, group):
    """The kernel's steps in torch, one (chunk, value head) at a time, in ``k``'s dtype
    (fp64 here): whole 64-row tiles as TMA reads them (rows past the chunk are the next
    rows of the tensor, zeros past ``T``), the masked ``A``, the substitution on the
    stacked transposed diagonal blocks, the two merge levels, the W/U operands with rows
    >= n selected to 0. Returns ``(A_inv, W, U)`` as the launcher does."""
    T, H, K = k.shape
    HV, V = v.shape[1:]
    dt = k.dtype
    A_out = torch.zeros(T, HV, 64, dtype=dt)
    W, U = torch.zeros(T, HV, K, dtype=dt), torch.zeros(T, HV, V, dtype=dt)
    r = torch.arange(64)
    zero = torch.zeros((), dtype=dt)

    def tile(x, bos, head):  # TMA: 64 rows from bos, zero-filled past T
        t = torch.zeros(64, x.shape[-1], dtype=dt)
        rows = x[bos:bos + 64, head]
        t[:rows.shape[0]] = rows
        return t

    for c in range(index.num_chunks):
        bos, n = int(index.chunk_start[c]), int(index.chunk_len[c])
        for hv in range(HV):
            Kt, Vt = tile(k, bos, hv // group), tile(v, bos, hv)
            valid = r < n
            g = torch.where(valid, tile(G[..., None], bos, hv)[:, 0], zero)
            b = torch.where(valid, tile(beta[..., None], bos, hv)[:, 0], zero)
            kk = Kt @ Kt.T
            m = (r[:, None] > r[None, :]) & valid[:, None]
            e = torch.where(m, g[:, None] - g[None, :], zero).exp()
            A = torch.where(m, kk * e * b[:, None], zero)
            yk = torch.where(valid[:, None], Kt * (b * g.exp())[:, None], zero)
            yv = torch.where(valid[:, None], Vt * b[:, None], zero)
            # diagonal blocks: xt[b, m, c] = X_b[c, m], 15 steps
            d = torch.stack([A[16 * i:16 * i + 16, 16 * i:16 * i + 16] for i in range(4)])
            c16 = torch.arange(16)
            xt = (c16[:, None] == c16[None, :]).to(dt).expand(4, 16, 16).clone()
            for i in range(1, 16):
                s = (xt * d[:, i:i + 1, :]).sum(2)
                xt = torch.where(c16[None, None, :] == i, xt - s[:, :, None], xt)
            X = torch.zeros(64, 64, dtype=dt)
            for i in range(4):
                X[16 * i:16 * i + 16, 16 * i:16 * i + 16] = xt[i].T
            for p in (0, 32):
                lo, hi = slice(p, p + 16), slice(p + 16, p + 32)
                X[hi, lo] = -(X[hi, hi] @ (A[hi, lo] @ X[lo, lo]))
            X[32:, :32] = -(X[32:, 32:] @ (A[32:, :32] @ X[:32, :32]))
            A_out[bos:bos + n, hv] = X[:n]
            W[bos:bos + n, hv] = (X @ yk)[:n]
            U[bos:bos + n, hv] = (X @ yv)[:n]
    return A_out, W, U


@pytest.mark.parametrize("lengths,group", [([5, 64, 70, 17, 49], 2), ([130], 1)])
def test_kernel_dataflow_matches_reference(lengths, group):
    """fp64, K = V = 128, packed documents with short last chunks, every block edge; a NaN
    in the first row of a document (which the short chunk before it reads) changes no
    other document's results."""
    f64 = torch.float64
    gen = torch.Generator().manual_seed(7)
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    bounds = list(zip(offs[:-1], offs[1:]))
    index = ChunkIndex.build(offs, "cpu")
    T, H, D = offs[-1], 1, 128
    HV = H * group
    k = torch.nn.functional.normalize(torch.randn(T, H, D, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(T, HV, D, generator=gen, dtype=f64)
    beta = torch.rand(T, HV, generator=gen, dtype=f64)
    g = torch.nn.functional.logsigmoid(torch.randn(T, HV, generator=gen, dtype=f64) + 2.0)
    G = R.chunk_cumsum_ref(g, bounds)
    A_inv, W, U = _emulate(k, v, beta, G, index, group)
    A_ref, W_ref, U_ref = R.wy_ref(k.repeat_interleave(group, 1), v, beta, G, bounds)
    for name, a, w in (("A_inv", A_inv, A_ref), ("W", W, W_ref), ("U", U, U_ref)):
        err = ((a - w).abs().max() / w.abs().max()).item()
        assert err <= 1e-12, f"{name}: {err:.3e}"
    if len(lengths) > 1:
        bad_k, bad_v = k.clone(), v.clone()
        bad_k[offs[1]] = float("nan")
        bad_v[offs[1]] = float("nan")
        A2, W2, U2 = _emulate(bad_k, bad_v, beta, G, index, group)
        for x, y in ((A2, A_inv), (W2, W), (U2, U)):
            assert torch.equal(x[:offs[1]], y[:offs[1]])
            assert torch.equal(x[offs[2]:], y[offs[2]:])
