"""The Gluon chunk-state launcher without a GPU: it imports, it is declared atomic-free, it
refuses what it does not serve (``ValueError``) and devices it cannot run on
(``RuntimeError``) before compiling anything; and a torch emulation of the kernel's
dataflow (whole 64-row tiles read past a document's end as TMA reads them, the bf16
roundings of ``h_c``, ``V'`` and ``K̃``, the row selects) in fp64 against the fp32
reference, with a NaN in the next document's rows. The kernel itself: ``*_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops.gluon import chunk_state as gs


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, chunk=64):
    index = ChunkIndex.build([0, T], "cpu", chunk_size=chunk)
    HV = H * group
    return (torch.zeros(T, H, K, dtype=dtype), torch.zeros(T, HV, K, dtype=dtype),
            torch.zeros(T, HV, V, dtype=dtype), torch.zeros(T, HV), index, group)


def test_declared_atomic_free():
    info = gs.chunk_state_fwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (gs._chunk_state_fwd_gluon_kernel,)


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(chunk=32)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not gs.gluon_chunk_state_supported(args[0], args[1], args[2], args[4])
    with pytest.raises(ValueError):
        gs.chunk_state_fwd_gluon(*args)


@pytest.mark.parametrize("kw", [dict(state_width=256), dict(identity_state=True),
                                dict(need=torch.ones(1, dtype=torch.int32))])
def test_extended_state_and_need_raise_value_error(kw):
    """The segment summaries' ``[E | M]`` state and ``need`` masks stay on the Triton path."""
    k, W, U, G, index, group = _args()
    assert not gs.gluon_chunk_state_supported(k, W, U, index, **kw)
    with pytest.raises(ValueError, match="plain state"):
        gs.chunk_state_fwd_gluon(k, W, U, G, index, group, store_states=False,
                                 store_v_new=False, **kw)


def test_mismatched_shapes_and_dtypes_raise_value_error():
    k, W, U, G, index, group = _args()
    with pytest.raises(ValueError, match="shape mismatch"):
        gs.chunk_state_fwd_gluon(k, W[:-1], U, G, index, group)
    with pytest.raises(ValueError, match="16-bit"):
        gs.chunk_state_fwd_gluon(k, W, U.half(), G, index, group)
    with pytest.raises(ValueError, match="initial_state"):
        gs.chunk_state_fwd_gluon(k, W, U, G, index, group, torch.zeros(2, 2, 128, 128))


def test_cpu_tensors_raise_runtime_error():
    k, W, U, G, index, group = _args()
    assert gs.gluon_chunk_state_supported(k, W, U, index)
    assert gs.gluon_chunk_state_supported(k, W, U, index, state_width=128)
    with pytest.raises(RuntimeError):
        gs.chunk_state_fwd_gluon(k, W, U, G, index, group)


def test_bad_block_knob_raises_value_error(monkeypatch):
    monkeypatch.setattr(gs, "GLUON_STATE_BV", 48)
    with pytest.raises(ValueError, match="GLUON_STATE_BV"):
        gs.chunk_state_fwd_gluon(*_args())


def _emulate(k, W, U, G, offs, group, h0, BT=64, BV=64):
    """The kernel's dataflow in fp64: per (value block, document, head), whole BT-row tiles
    of the packed tensors (zeros past T, the next document's rows past eos), h_c and V' and
    K̃ rounded to k's dtype, rows >= n selected away."""
    T, HV, V = U.shape
    K = k.shape[-1]
    dt = k.dtype
    pad = lambda x: torch.cat([x, x.new_zeros(BT, *x.shape[1:])])  # noqa: E731 - TMA's zero fill
    kp, Wp, Up = pad(k), pad(W), pad(U)
    N = len(offs) - 1
    NT = sum(-(-(offs[i + 1] - offs[i]) // BT) for i in range(N))
    h = torch.zeros(NT, HV, K, V, dtype=torch.float64)
    vn_out = torch.zeros(T, HV, V, dtype=torch.float64)
    final = torch.zeros(N, HV, K, V, dtype=torch.float64)
    rows = torch.arange(BT)
    for iv in range(V // BV):
        cols = slice(iv * BV, iv * BV + BV)
        c = 0
        for d in range(N):
            bos, eos = offs[d], offs[d + 1]
            for hv in range(HV):
                S = (h0[d, hv, :, cols].double() if h0 is not None
                     else torch.zeros(K, BV, dtype=torch.float64))
                for ic in range(-(-(eos - bos) // BT)):
                    t0 = bos + ic * BT
                    n = min(eos - t0, BT)
                    m = rows < n
                    g = torch.zeros(BT, dtype=torch.float64)  # G loaded masked
                    g[:n] = G[t0:t0 + n, hv].double()
                    g_last = G[t0 + n - 1, hv].double()
                    hc = S.to(dt).double()
                    h[c + ic, hv, :, cols] = hc
                    P = Wp[t0:t0 + BT, hv].double() @ hc
                    vn = torch.where(m[:, None], Up[t0:t0 + BT, hv, cols].double() - P, 0.0)
                    vn16 = vn.to(dt).double()
                    vn_out[t0:t0 + n, hv, cols] = vn16[:n]
                    dec = torch.where(m, torch.exp(torch.where(m, g_last - g, 0.0)), 0.0)
                    kt = torch.where(m[:, None],
                                     (kp[t0:t0 + BT, hv // group].double() * dec[:, None])
                                     .to(dt).double(), 0.0)
                    S = S * torch.exp(g_last) + kt.T @ vn16
                final[d, hv, :, cols] = S
            c += -(-(eos - bos) // BT)
    return h, vn_out, final


def _rel(a, b):
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def test_emulated_dataflow_matches_reference_and_contains_nan():
    """Small heads (K = V = 32, BV = 16; the dataflow does not depend on the size): the
    emulation within bf16 tolerance of ``chunk_states_ref``; the same bits at another BV;
    a NaN in the first row of the document after a short chunk changes nothing before it."""
    gen = torch.Generator().manual_seed(3)
    offs = [0, 70, 134, 200]
    T, H, group, K, V = offs[-1], 1, 2, 32, 32
    HV = H * group
    bounds = list(zip(offs[:-1], offs[1:]))
    k = R.l2_normalize(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, HV, V, generator=gen)
    beta = torch.rand(T, HV, generator=gen)
    G = R.chunk_cumsum_ref(-torch.rand(T, HV, generator=gen) * 0.3 - 0.01, bounds)
    ke = k.repeat_interleave(group, dim=1)
    _, W, U = R.wy_ref(ke, v, beta, G, bounds)
    k16, W16, U16 = (x.to(torch.bfloat16) for x in (k, W, U))
    h0 = torch.randn(len(bounds), HV, K, V, generator=gen) * 0.1
    h, vn, fin = _emulate(k16, W16, U16, G, offs, group, h0, BV=16)
    h_ref, vn_ref, fin_ref = R.chunk_states_ref(ke.to(torch.bfloat16).float(), W16.float(),
                                                U16.float(), G, bounds, h0)
    assert _rel(h, h_ref) <= 1e-2 and _rel(vn, vn_ref) <= 1e-2 and _rel(fin, fin_ref) <= 1e-2
    h2, vn2, fin2 = _emulate(k16, W16, U16, G, offs, group, h0, BV=32)
    assert torch.equal(h, h2) and torch.equal(vn, vn2) and torch.equal(fin, fin2)

    bad = [x.clone() for x in (k16, W16, U16)]
    for x in bad:
        x[offs[1]] = float("nan")  # read by document 0's short last chunk
    hn, vnn, finn = _emulate(*bad, G, offs, group, h0, BV=16)
    assert torch.equal(fin[0], finn[0]) and torch.equal(vn[:offs[1]], vnn[:offs[1]])
    assert torch.equal(h[:2], hn[:2]) and torch.equal(fin[2], finn[2])
