"""The Gluon chunk-gradient launchers without a GPU: they import, they are declared
atomic-free, and they refuse what they do not serve (``ValueError``) and devices they
cannot run on (``RuntimeError``) before compiling anything — the one-tile launcher and the
persistent one (:mod:`~gdn_core.ops.gluon.chunk_grads_pipelined`), which share these
checks. The kernels themselves: ``*_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops.gluon import chunk_grads as gc
from gdn_core.ops.gluon import chunk_grads_pipelined as gp

#: (launcher, its supported test): the one-tile kernel's and the persistent kernel's
LAUNCHERS = [pytest.param((gc.chunk_grads_bwd_gluon, gc.gluon_chunk_grads_supported),
                          id="one_tile"),
             pytest.param((gp.chunk_grads_bwd_gluon_pipelined,
                           gp.gluon_chunk_grads_pipelined_supported), id="persistent")]


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, a_dtype=None):
    index = ChunkIndex.build([0, T], "cpu")
    HV, NT = H * group, index.num_chunks
    q = torch.zeros(T, H, K, dtype=dtype)
    v = torch.zeros(T, HV, V, dtype=dtype)
    h = torch.zeros(NT, HV, K, V, dtype=dtype)
    a = torch.zeros(T, HV, 64, dtype=a_dtype or dtype)
    return [q, q.clone(), v, v.clone(), h, h.clone(), v.clone(), v.clone(), torch.zeros(T, HV),
            torch.zeros(T, HV), a, 0.5, index, group, torch.float32]


def test_declared_atomic_free():
    info = gc.chunk_grads_bwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (gc._chunk_grads_bwd_gluon_kernel,)


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(a_dtype=torch.float32)])
@pytest.mark.parametrize("launch", LAUNCHERS)
def test_unsupported_shapes_and_dtypes_raise_value_error(launch, kw):
    launcher, supported = launch
    args = _args(**kw)
    assert not supported(args[0], args[2], args[10], args[12])
    with pytest.raises(ValueError):
        launcher(*args)


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_mismatched_shapes_and_dtypes_raise_value_error(launch):
    launcher = launch[0]
    args = _args()
    bad = list(args)
    bad[5] = args[5][:-1]  # dh of too few chunks
    with pytest.raises(ValueError, match="shape mismatch"):
        launcher(*bad)
    bad = list(args)
    bad[7] = args[7].half()  # du in another 16-bit dtype
    with pytest.raises(ValueError, match="16-bit"):
        launcher(*bad)
    T, HV = args[2].shape[:2]
    for kw in ({"dq": torch.empty(T, HV, 129)}, {"dk": torch.empty(T, HV, 256)[..., :128]}):
        with pytest.raises(ValueError, match="must be a contiguous"):
            launcher(*args, **kw)


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_cpu_tensors_raise_runtime_error(launch):
    launcher, supported = launch
    args = _args()
    assert supported(args[0], args[2], args[10], args[12])
    with pytest.raises(RuntimeError):
        launcher(*args)


# ------------------------------------------------- the kernel's dataflow, emulated


def _emulate(q, k, v, v_new, h, dh, do, du, G, beta, A_inv, scale, index, group):
    """The Gluon kernel's products, masks and sums in the kernel's order, in torch (one
    (chunk, value head) at a time, rows >= n zero as the kernel zeroes them in shared
    memory). Pins the dataflow the kernel docstring describes (the column scalings of
    dT, diag(β)E' as Eᵀ's operand, dg's terms) against autograd; the kernel itself is
    tested on the GPU."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    BT = index.chunk_size
    dq, dk, dv = (torch.zeros(T, HV, K, dtype=q.dtype) for _ in range(3))
    db, dg = torch.zeros(T, HV, dtype=q.dtype), torch.zeros(T, HV, dtype=q.dtype)
    r = torch.arange(BT)
    zero = torch.zeros((), dtype=q.dtype)

    def cross(M):  # crossing sums
        cs = torch.where(r[:, None] > r[None, :], M.cumsum(1), zero).sum(0)
        return torch.where(r[None, :] == r[:, None] - 1, cs[None, :], zero).sum(1)

    def suffix(x):
        return torch.where(r[:, None] >= r[None, :], x[:, None], zero).sum(0)

    for c in range(index.num_chunks):
        bos, n = int(index.chunk_start[c]), int(index.chunk_len[c])
        sl = slice(bos, bos + n)
        for hv in range(HV):
            def tile(x, head, sl=sl, n=n):
                t = torch.zeros(BT, x.shape[-1], dtype=x.dtype)
                t[:n] = x[sl, head]
                return t

            Q, Kk, Vv, VN, DO, DU = (tile(x, hd) for x, hd in (
                (q, hv // group), (k, hv // group), (v, hv), (v_new, hv), (do, hv), (du, hv)))
            Tm = tile(A_inv, hv)
            Tm[:, n:] = 0
            S, dS = h[c, hv], dh[c, hv]
            g, b = (torch.where(r < n, tile(x[..., None], hv)[:, 0], zero) for x in (G, beta))
            valid = r < n
            gam = torch.where(valid, g.exp(), zero)
            g_last = G[bos + n - 1, hv]
            m_low = (r[:, None] >= r[None, :]) & valid[:, None]
            ds = (DO @ VN.T) * torch.where(m_low, g[:, None] - g[None, :],
                                           torch.tensor(float("-inf"), dtype=q.dtype)).exp()
            ds = ds * scale
            cs_o = cross(ds * (Q @ Kk.T))
            dvt, x1 = Tm.T @ DU, DU @ Vv.T
            db_v = (dvt * Vv).sum(1)
            dqs = (DO @ S.T) * (gam * scale)[:, None]
            dgq = (Q * dqs).sum(1)
            dW = -(DU @ S.T)
            d_t = x1 * b[None, :] + (dW @ Kk.T) * (b * gam)[None, :]
            da = Tm.T @ (d_t @ Tm.T)
            m1 = (r[:, None] > r[None, :]) & valid[:, None]
            e = torch.where(m1, -da * torch.where(m1, g[:, None] - g[None, :], zero).exp(), zero)
            cs_w = cross(e * b[:, None] * (Kk @ Kk.T))
            acc = (Tm.T @ dW) * gam[:, None]
            wr = (acc * Kk).sum(1)
            acc = acc + e @ Kk
            db_c = (acc * Kk).sum(1)
            acc = acc * b[:, None] + (e * b[:, None]).T @ Kk
            dks = (VN @ dS.T) * torch.where(valid, (g_last - g).exp(), zero)[:, None]
            kds = (Kk * dks).sum(1)
            acc = acc + dks + ds.T @ Q
            dgv = cs_w + cs_o + g_last.exp() * (S * dS).sum()
            dgv = dgv + torch.where(r[:, None] < r[None, :], kds[:, None], zero).sum(0)
            dgv = dgv + suffix(b * wr) + suffix(dgq)
            dq[sl, hv], dk[sl, hv], dv[sl, hv] = (ds @ Kk + dqs)[:n], acc[:n], (
                dvt * b[:, None])[:n]
            db[sl, hv], dg[sl, hv] = (db_c + db_v)[:n], dgv[:n]
    return dq, dk, dv, db, dg


def _state_next(k, v_new, h, G, chunks):
    return torch.stack([h[c] * G[e - 1].exp()[:, None, None] + torch.einsum(
        "ihk,ihv->hkv", k[s:e] * (G[e - 1][None] - G[s:e]).exp()[..., None], v_new[s:e])
        for c, (s, e) in enumerate(chunks)])


@pytest.mark.parametrize("lengths,group", [([5, 64, 70], 2), ([64], 1)])
def test_kernel_dataflow_matches_autograd(lengths, group):
    """fp64, K = V = 128: the emulated dataflow against autograd of the stage references
    (as ``test_ops_backward.py::test_chunk_grads_bwd`` builds it)."""
    from gdn_core import reference as ref

    f64 = torch.float64
    gen = torch.Generator().manual_seed(31)
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    bounds = list(zip(offs[:-1], offs[1:]))
    index = ChunkIndex.build(offs, "cpu")
    chunks = [(s, min(e, s + 64)) for b, e in bounds for s in range(b, e, 64)]
    T, H, D = offs[-1], 1, 128
    HV, NT = H * group, len(chunks)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64)

    q, k, v = rnd(T, H, D), torch.nn.functional.normalize(rnd(T, H, D), dim=-1), rnd(T, HV, D)
    g = torch.nn.functional.logsigmoid(rnd(T, HV) + 2.0) * 0.5
    beta = torch.rand(T, HV, generator=gen, dtype=f64).sigmoid()
    v_new, do, du, h, dh = rnd(T, HV, D), rnd(T, HV, D), rnd(T, HV, D), rnd(NT, HV, D, D) * 0.3, \
        rnd(NT, HV, D, D)
    scale = D**-0.5
    leaves = [x.clone().requires_grad_(True) for x in (q.repeat_interleave(group, 1),
                                                        k.repeat_interleave(group, 1), v, beta, g)]
    qe, ke, vl, bl, gl = leaves
    G = ref.chunk_cumsum_ref(gl, bounds)
    A_inv, W, U = ref.wy_ref(ke, vl, bl, G, bounds)
    dW = torch.cat([-torch.einsum("ihv,hkv->ihk", du[s:e], h[c]) for c, (s, e) in
                    enumerate(chunks)])
    loss = ((ref.chunk_output_ref(qe, ke, v_new, h, G, scale, bounds) * do).sum()
            + (_state_next(ke, v_new, h, G, chunks) * dh).sum() + (W * dW).sum()
            + (U * du).sum())
    want = torch.autograd.grad(loss, leaves)
    got = _emulate(q, k, v, v_new, h, dh, do, du, G.detach(), beta, A_inv.detach(), scale,
                   index, group)
    for name, a, w in zip(("dq", "dk", "dv", "dbeta", "dg"), got, want):
        err = ((a - w).abs().max() / w.abs().max()).item()
        assert err <= 1e-12, f"{name}: {err:.3e}"
