"""The Gluon dv_local launcher without a GPU: it imports, it is declared atomic-free, it
takes the Triton launcher's parameters, and it refuses what it does not serve
(``ValueError``) and devices it cannot run on (``RuntimeError``) before compiling
anything; and the kernel's dataflow (``Pᵀ = K Qᵀ`` as the accumulator, the masked
exponent and select, a short chunk's foreign dO rows zeroed in shared memory, rows
``≥ n`` never stored), emulated in fp64, against a direct fp64 formula (itself checked
against autograd of the reference stage and against the Triton kernel in the
interpreter). The kernel itself: ``*_gpu.py``."""

from __future__ import annotations

import inspect

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops.dv_local import dv_local_bwd
from gdn_core.ops.gluon import dv_local as gd


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, do_dtype=None):
    index = ChunkIndex.build([0, T], "cpu")
    HV = H * group
    q = torch.zeros(T, H, K, dtype=dtype)
    return [q, q.clone(), torch.zeros(T, HV), torch.zeros(T, HV, V, dtype=do_dtype or dtype),
            0.5, index, group]


def test_declared_atomic_free():
    info = gd.dv_local_bwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (gd._dv_local_gluon_kernel,)


def test_signature_is_the_triton_launchers():
    got = inspect.signature(gd.dv_local_bwd_gluon).parameters
    want = inspect.signature(dv_local_bwd).parameters
    assert [(p.name, p.kind, p.default) for p in got.values()] == \
        [(p.name, p.kind, p.default) for p in want.values()]


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(do_dtype=torch.float16)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not gd.gluon_dv_local_supported(args[0], args[3], args[5])
    with pytest.raises(ValueError):
        gd.dv_local_bwd_gluon(*args)


def test_other_chunk_sizes_are_not_served():
    args = _args()
    args[5] = ChunkIndex.build([0, 70], "cpu", chunk_size=32)
    assert not gd.gluon_dv_local_supported(args[0], args[3], args[5])
    with pytest.raises(ValueError, match="chunks of 64"):
        gd.dv_local_bwd_gluon(*args)


def test_mismatched_shapes_and_buffers_raise_value_error():
    q, k, G, do, scale, index, group = _args()
    with pytest.raises(ValueError, match="shape mismatch"):
        gd.dv_local_bwd_gluon(q, k, G[:, :1], do, scale, index, group)
    with pytest.raises(ValueError, match="shape mismatch"):
        gd.dv_local_bwd_gluon(q, k, G, do, scale, index, 1)
    with pytest.raises(ValueError, match="16-bit"):
        gd.dv_local_bwd_gluon(q, k.half(), G, do, scale, index, group)
    T, HV, V = do.shape
    for out in (torch.empty(T, HV, V), torch.empty(T, HV, 2 * V, dtype=q.dtype)[..., :V],
                torch.empty(T - 1, HV, V, dtype=q.dtype)):
        with pytest.raises(ValueError, match="out must be"):
            gd.dv_local_bwd_gluon(q, k, G, do, scale, index, group, out=out)


def test_cpu_tensors_raise_runtime_error():
    args = _args()
    assert gd.gluon_dv_local_supported(args[0], args[3], args[5])
    with pytest.raises(RuntimeError):
        gd.dv_local_bwd_gluon(*args)
    with pytest.raises(RuntimeError):
        gd.dv_local_bwd_gluon(*args, out=torch.empty_like(args[3]))


# ------------------------------------------------- the kernel's dataflow, emulated


def _direct(q, k, G, do, scale, offs, group, C=64):
    """``scale · (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j])ᵀ dO`` per chunk, as the Triton kernel's
    docstring writes it."""
    T, H, K = k.shape
    HV, V = do.shape[1:]
    dv = torch.zeros(T, HV, V, dtype=q.dtype)
    for bos, eos in zip(offs[:-1], offs[1:]):
        for t0 in range(bos, eos, C):
            sl = slice(t0, min(eos, t0 + C))
            L = sl.stop - sl.start
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            for hv in range(HV):
                h = hv // group
                g = G[sl, hv]
                decay = (g[:, None] - g[None, :]).masked_fill(~causal, float("-inf")).exp()
                P = q[sl, h] @ k[sl, h].T * decay * scale  # P[i, j]
                dv[sl, hv] = P.T @ do[sl, hv]
    return dv


def _emulate(q, k, G, do, scale, offs, group, C=64):
    """The Gluon kernel's dataflow: per (chunk, value head) 64-row tiles of K, Q, dO read
    from the chunk's first row (the next document's rows past a short chunk's end, zeros
    past T), G loaded with the row mask, ``Pᵀ = K Qᵀ`` as a ``[j, i]`` tile, the exponent
    masked before ``exp`` and the product selected, dO's foreign rows zeroed (``where``:
    clears NaN too) before ``Pᵀ dO``, rows ``< n`` stored (the rest of the result keeps
    its NaN fill: a row not stored would show)."""
    T, H, K = k.shape
    HV, V = do.shape[1:]
    zero = torch.zeros((), dtype=q.dtype)
    tok = torch.arange(C)
    dv = torch.full((T, HV, V), float("nan"), dtype=q.dtype)

    def tile(x, t0, cols):  # TMA: 64 rows from t0, zeros past T
        out = torch.zeros(C, cols.stop - cols.start, dtype=x.dtype)
        rows = x[t0:min(T, t0 + C), cols]
        out[:rows.shape[0]] = rows
        return out

    chunks = [(t0, min(eos - t0, C)) for bos, eos in zip(offs[:-1], offs[1:])
              for t0 in range(bos, eos, C)]
    for t0, n in chunks:
        for hv in range(HV):
            h = hv // group
            Kt = tile(k.flatten(1), t0, slice(h * K, h * K + K))
            Qt = tile(q.flatten(1), t0, slice(h * K, h * K + K))
            DO = tile(do.flatten(1), t0, slice(hv * V, hv * V + V))
            g = torch.where(tok < n, tile(G, t0, slice(hv, hv + 1))[:, 0], zero)
            s = Kt @ Qt.T  # [j, i]
            if n < C:
                DO = torch.where((tok < n)[:, None], DO, zero)
            causal = (tok[None, :] >= tok[:, None]) & (tok[None, :] < n)
            decay = torch.where(causal, g[None, :] - g[:, None], zero).exp()
            p = torch.where(causal, s * decay * scale, zero)
            acc = p @ DO
            dv[t0:t0 + n, hv] = acc[:n]
    return dv


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
    do = rnd(T, HV, V)
    g = torch.nn.functional.logsigmoid(rnd(T, HV) + 2.0) * 0.5
    G = R.chunk_cumsum_ref(g, list(zip(offs[:-1], offs[1:])))
    return offs, [x.to(dtype) for x in (q, k, G, do)]


LENGTHS = [5, 64, 0, 70, 130, 3]  # short chunks mid-pack and at the end of T, an empty doc


@pytest.mark.parametrize("group", [1, 2])
def test_kernel_dataflow_matches_direct_formula(group):
    """fp64, K = V = 128, packed documents with short last chunks (the last one at the end
    of T: TMA's zeros) and an empty one; NaN in the first row of the documents after a
    short chunk (rows the kernel reads through TMA and drops or zeroes) changes no other
    document's result."""
    offs, (q, k, G, do) = _problem(LENGTHS, 2, group, 128, 128, seed=3)
    scale = 128**-0.5
    want = _direct(q, k, G, do, scale, offs, group)
    clean = _emulate(q, k, G, do, scale, offs, group)
    assert torch.isfinite(clean).all()
    err = ((clean - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-12, f"{err:.3e}"
    # NaN in the first row of documents 1, 3, 5 (read by the short chunks of 0, 2/3, 4)
    bad = [x.clone() for x in (q, k, do)]
    for x in bad:
        x[[offs[1], offs[3], offs[5]]] = float("nan")
    got = _emulate(bad[0], bad[1], G, bad[2], scale, offs, group)
    for d in (0, 2, 4):
        sl = slice(offs[d], offs[d + 1])
        assert torch.equal(got[sl], clean[sl]), f"document {d}"
    for d in (1, 3, 5):  # the poisoned row's own document: its first chunk only
        assert torch.isnan(got[offs[d]]).any()


def test_direct_formula_matches_reference_autograd():
    """The direct formula against autograd of ``reference.chunk_output_ref`` through
    ``v_new`` (how the Triton kernel's own test defines the stage), fp64, group 2."""
    offs, (q, k, G, do) = _problem([5, 64, 70], 1, 2, 32, 16, seed=4)
    bounds = list(zip(offs[:-1], offs[1:]))
    index = ChunkIndex.build(offs, "cpu")
    vn = torch.randn(q.shape[0], 2, 16, dtype=torch.float64).requires_grad_(True)
    h = torch.zeros(index.num_chunks, 2, 32, 16, dtype=torch.float64)
    qe, ke = (x.repeat_interleave(2, dim=1) for x in (q, k))
    o = R.chunk_output_ref(qe, ke, vn, h, G, 0.3, bounds)
    want = torch.autograd.grad((o * do).sum(), vn)[0]
    got = _direct(q, k, G, do, 0.3, offs, 2)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-12


def test_direct_formula_matches_triton_kernel():
    """The direct formula against the Triton ``_dv_local_kernel`` (the interpreter, fp32,
    small heads): the emulation's reference is the kernel's contract."""
    offs, xs = _problem([5, 64, 70], 1, 2, 32, 32, seed=5, dtype=torch.float32)
    q, k, G, do = xs
    index = ChunkIndex.build(offs, "cpu")
    got = dv_local_bwd(q, k, G, do, 0.3, index, 2)
    want = _direct(*(x.double() for x in xs), 0.3, offs, 2)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"{err:.3e}"
