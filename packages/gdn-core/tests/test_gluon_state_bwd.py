"""The Gluon state-backward launcher without a GPU: it imports, it is declared atomic-free,
and it refuses what it does not serve (``ValueError``) and devices it cannot run on
(``RuntimeError``) before compiling anything; and the kernel's transposed dataflow
(``dSᵀ`` as the accumulator, a short chunk's foreign rows zeroed in shared memory),
emulated in fp64, against a direct fp64 recurrence (itself checked against the Triton
kernel in the interpreter). The kernel itself: ``*_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops.gluon import chunk_state_bwd as gs


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, w_dtype=None, N=1):
    index = ChunkIndex.build([0] + [T * (i + 1) // N for i in range(N)], "cpu")
    HV = H * group
    q = torch.zeros(T, H, K, dtype=dtype)
    W = torch.zeros(T, HV, K, dtype=w_dtype or dtype)
    do = torch.zeros(T, HV, V, dtype=dtype)
    return [q, q.clone(), W, torch.zeros(T, HV), do, do.clone(),
            torch.zeros(index.num_docs, HV, K, V), 0.5, index, group]


def test_declared_atomic_free():
    info = gs.chunk_state_bwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (gs._chunk_state_bwd_gluon_kernel,)


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(w_dtype=torch.float16)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not gs.gluon_state_bwd_supported(args[0], args[2], args[4], args[5], args[8])
    with pytest.raises(ValueError):
        gs.chunk_state_bwd_gluon(*args)


def test_mismatched_shapes_and_buffers_raise_value_error():
    args = _args(N=2)
    bad = list(args)
    bad[6] = args[6][:1]  # dht of too few documents
    with pytest.raises(ValueError, match="shape mismatch"):
        gs.chunk_state_bwd_gluon(*bad)
    bad = list(args)
    bad[5] = args[5].half()  # dv_local in another 16-bit dtype
    with pytest.raises(ValueError, match="16-bit"):
        gs.chunk_state_bwd_gluon(*bad)
    T, HV, V = args[4].shape
    K, NT, N = args[0].shape[2], args[8].num_chunks, args[8].num_docs
    with pytest.raises(ValueError, match="need must be"):
        gs.chunk_state_bwd_gluon(*args, need=torch.ones(N, dtype=torch.int64))
    for kw in ({"dh": torch.empty(NT, HV, K, V)},  # fp32, not q's dtype
               {"dv": torch.empty(T, HV, 2 * V, dtype=torch.bfloat16)[..., :V]},
               {"dh0": torch.empty(N, HV, K, V, dtype=torch.float64)}):
        with pytest.raises(ValueError, match="must be a contiguous"):
            gs.chunk_state_bwd_gluon(*args, **kw)


def test_cpu_tensors_raise_runtime_error():
    args = _args()
    assert gs.gluon_state_bwd_supported(args[0], args[2], args[4], args[5], args[8])
    with pytest.raises(RuntimeError):
        gs.chunk_state_bwd_gluon(*args)
    with pytest.raises(RuntimeError):
        gs.chunk_state_bwd_gluon(*args, store=False)


# ------------------------------------------------- the kernel's dataflow, emulated


def _direct(q, k, W, G, do, dv_local, dht, scale, offs, group, C=64):
    """The recurrence as the Triton kernel's docstring writes it (untransposed)."""
    T, H, K = k.shape
    HV, V = do.shape[1:]
    dh, dv = [], torch.zeros(T, HV, V, dtype=q.dtype)
    dh0 = torch.zeros(len(offs) - 1, HV, K, V, dtype=q.dtype)
    for n, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        per_doc = []
        for hv in range(HV):
            h = hv // group
            dS = dht[n, hv].clone() if dht is not None else torch.zeros(K, V, dtype=q.dtype)
            states = []
            for t0 in reversed(range(bos, eos, C)):
                sl = slice(t0, min(eos, t0 + C))
                states.append(dS.clone())
                g = G[sl, hv]
                dvp = dv_local[sl, hv] + (k[sl, h] * (g[-1] - g).exp()[:, None]) @ dS
                dv[sl, hv] = dvp
                dS = (g[-1].exp() * dS + q[sl, h].T @ (do[sl, hv] * (g.exp() * scale)[:, None])
                      - W[sl, hv].T @ dvp)
            dh0[n, hv] = dS
            per_doc.append(states[::-1])
        dh += [torch.stack([per_doc[hv][c] for hv in range(HV)])
               for c in range(len(per_doc[0]) if per_doc else 0)]
    return (torch.stack(dh) if dh else q.new_zeros(0, HV, K, V)), dv, dh0


def _emulate(q, k, W, G, do, dv_local, dht, scale, offs, group, BV, C=64):
    """The Gluon kernel's dataflow: per (document, value head, BV columns) the transposed
    state ``dSᵀ [BV, K]``, 64-row tiles read past a short chunk's end (the next document's
    rows, zeros past T) and zeroed in "shared memory" before use, G masked, ``Xᵀ = dSᵀ Kᵀ``,
    ``dV'ᵀ = Xᵀ ⊙ kd + dv_localᵀ``, ``dSᵀ ← e dSᵀ + (Γ scale dO)ᵀ Q − dV'ᵀ W``; ``dv`` stored
    for rows < n only."""
    T, H, K = k.shape
    HV, V = do.shape[1:]
    zero = torch.zeros((), dtype=q.dtype)
    tok = torch.arange(C)
    NT = sum(-(-(e - b) // C) for b, e in zip(offs[:-1], offs[1:]))
    dh = torch.full((NT, HV, K, V), float("nan"), dtype=q.dtype)
    dv = torch.full((T, HV, V), float("nan"), dtype=q.dtype)
    dh0 = torch.zeros(len(offs) - 1, HV, K, V, dtype=q.dtype)

    def tile(x, t0, cols):  # TMA: 64 rows from t0, zeros past T
        out = torch.zeros(C, cols.stop - cols.start, dtype=x.dtype)
        rows = x[t0:min(T, t0 + C), cols]
        out[:rows.shape[0]] = rows
        return out

    c0 = 0
    for n, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        nc = -(-(eos - bos) // C)
        for hv in range(HV):
            h = hv // group
            for v0 in range(0, V, BV):
                vs = slice(v0, v0 + BV)
                dsT = (dht[n, hv][:, vs].T.clone() if dht is not None
                       else torch.zeros(BV, K, dtype=q.dtype))
                for it in range(nc):
                    ic = nc - 1 - it
                    t0 = bos + ic * C
                    L = min(eos - t0, C)
                    Qt = tile(q.flatten(1), t0, slice(h * K, h * K + K))
                    Kt = tile(k.flatten(1), t0, slice(h * K, h * K + K))
                    Wt = tile(W.flatten(1), t0, slice(hv * K, hv * K + K))
                    DO = tile(do.flatten(1), t0, slice(hv * V + v0, hv * V + v0 + BV))
                    DVL = tile(dv_local.flatten(1), t0, slice(hv * V + v0, hv * V + v0 + BV))
                    if L < C:  # zero the foreign rows (where: also clears NaN)
                        for x in (Qt, Kt, Wt, DO, DVL):
                            x.copy_(torch.where((tok < L)[:, None], x, zero))
                    g = torch.where(tok < L, tile(G, t0, slice(hv, hv + 1))[:, 0], zero)
                    g_last = G[t0 + L - 1, hv]
                    kd = torch.where(tok < L, (g_last - g).exp(), zero)
                    gam = torch.where(tok < L, g.exp() * scale, zero)
                    dh[c0 + ic, hv][:, vs] = dsT.T
                    xT = dsT @ Kt.T
                    acc = dsT * g_last.exp()
                    acc = acc + (DO * gam[:, None]).T @ Qt
                    dvpT = xT * kd[None, :] + DVL.T
                    dv[t0:t0 + L, hv, vs] = dvpT.T[:L]
                    dsT = acc + (-dvpT) @ Wt
                dh0[n, hv][:, vs] = dsT.T
        c0 += nc
    return dh, dv, dh0


def _problem(lengths, H, group, K, V, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    T, HV = offs[-1], H * group

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(T, H, K) * 0.2
    k = torch.nn.functional.normalize(rnd(T, H, K), dim=-1)
    W = rnd(T, HV, K) * 0.1
    do, dvl = rnd(T, HV, V), rnd(T, HV, V)
    g = torch.nn.functional.logsigmoid(rnd(T, HV) + 2.0) * 0.5
    G = g.clone()  # within-chunk cumsum
    for b, e in zip(offs[:-1], offs[1:]):
        for s in range(b, e, 64):
            G[s:min(e, s + 64)] = g[s:min(e, s + 64)].cumsum(0)
    dht = rnd(len(lengths), HV, K, V)
    return offs, [x.to(dtype) for x in (q, k, W, G, do, dvl, dht)]


@pytest.mark.parametrize("BV", [64, 128])
def test_kernel_dataflow_matches_direct_recurrence(BV):
    """fp64, K = V = 128, packed documents with short last chunks (and an empty one),
    group 2; NaN in the first row of the documents after a short chunk (rows the kernel
    reads through TMA and zeroes) changes nothing; the results do not depend on BV."""
    offs, (q, k, W, G, do, dvl, dht) = _problem([5, 64, 0, 70, 130], 1, 2, 128, 128, seed=3)
    scale = 128**-0.5
    want = _direct(q, k, W, G, do, dvl, dht, scale, offs, 2)
    clean = _emulate(q, k, W, G, do, dvl, dht, scale, offs, 2, BV)
    for name, c, w in zip(("dh", "dv", "dh0"), clean, want):
        err = ((c - w).abs().max() / w.abs().max()).item()
        assert err <= 1e-12, f"{name}: {err:.3e}"
    # NaN in the first row of documents 1 and 4 (read by the short chunks of 0 and 3)
    bad = [x.clone() for x in (q, k, W, do, dvl)]
    for x in bad:
        x[[offs[1], offs[4]]] = float("nan")
    got = _emulate(bad[0], bad[1], bad[2], G, bad[3], bad[4], dht, scale, offs, 2, BV)
    for d, chunks in ((0, [0]), (2, []), (3, [2, 3])):
        assert torch.equal(got[2][d], clean[2][d]), f"dh0 of document {d}"
        assert torch.equal(got[1][offs[d]:offs[d + 1]], clean[1][offs[d]:offs[d + 1]])
        for c in chunks:
            assert torch.equal(got[0][c], clean[0][c]), f"dh chunk {c}"


def test_direct_recurrence_matches_triton_kernel():
    """The direct recurrence above against the Triton ``_chunk_state_bwd_kernel`` (the
    interpreter, fp32, small heads): the emulation's reference is the kernel's contract."""
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd

    K = V = 32
    offs, xs = _problem([5, 64, 70], 1, 2, K, V, seed=5, dtype=torch.float32)
    q, k, W, G, do, dvl, dht = xs
    index = ChunkIndex.build(offs, "cpu")
    dh, dv, dh0 = chunk_state_bwd(q, k, W, G, do, dvl.clone(), dht, 0.3, index, 2)
    want = _direct(*(x.double() for x in xs[:6]), dht.double(), 0.3, offs, 2)
    for name, a, w in zip(("dh", "dv", "dh0"), (dh, dv, dh0), want):
        err = ((a.double() - w).abs().max() / w.abs().max()).item()
        assert err <= 1e-4, f"{name}: {err:.3e}"
