"""The backward's last phase in slabs (``gdn_core.bwd_slabs``): the same bits as the
whole call, on the Triton kernels (the interpreter here; ``-m gpu`` on the GPU)."""

from __future__ import annotations

import pytest
import torch
from gdn_core import bwd_slabs
from gdn_core.chunking import ChunkIndex
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.ops import chunk_state

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

_interpreted = type(chunk_state._chunk_state_fwd_kernel).__name__ == "InterpretedFunction"
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
               not _interpreted, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs CUDA")])]


def _inputs(lengths, H, HV, K, dtype, device, seed=0):
    T, N = sum(lengths), len(lengths)
    gen = torch.Generator().manual_seed(seed)
    # |k| ~ 1 (without the in-kernel L2 norm a |k| ~ sqrt(K) makes the recurrence diverge
    # over a few hundred tokens at K = 128: both paths would give NaN, and NaN != NaN)
    q = torch.randn(1, T, H, K, generator=gen) / K**0.5
    k = torch.randn(1, T, H, K, generator=gen) / K**0.5
    v = torch.randn(1, T, HV, K, generator=gen)
    g = -0.4 * torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = torch.randn(N, HV, K, K, generator=gen)
    do = torch.randn(1, T, HV, K, generator=gen)
    dht = torch.randn(N, HV, K, K, generator=gen)
    out = [x.to(device, dtype) for x in (q, k, v, beta, do)]
    return (out[0], out[1], out[2], g.to(device), out[3], h0.to(device), out[4],
            dht.to(device))


def _run(ins, offs, S, l2, h0, dht):
    q, k, v, g, beta, h, do, dh = ins
    o, _, saved = chunk_gdn_fwd(q, k, v, g, beta, initial_state=h if h0 else None,
                                output_final_state=True, cu_seqlens=offs,
                                use_qk_l2norm_in_kernel=l2, deterministic=True,
                                backend="triton", segment_size=S)
    grads = chunk_gdn_bwd(saved, do, dh if dht else None, deterministic=True)
    return {n: getattr(grads, n) for n in GRADS}, saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths,H,HV,S,l2,h0,dht,slab,half", [
    ([300, 1, 40, 329], 1, 2, 128, True, True, True, 128, False),   # long docs: the fold
    ([300, 1, 40, 329], 1, 2, 128, True, True, True, 500, True),    # fewer, uneven slabs
    ([200, 70, 5, 130], 2, 4, 64, False, False, False, 64, False),  # GQA (dq partials)
    ([90, 33, 64, 1, 100], 1, 1, 0, True, False, True, 100, True),  # the plain path
])
def test_slabs_give_the_whole_calls_bits(monkeypatch, device, lengths, H, HV, S, l2, h0, dht,
                                         slab, half):
    """``half``: 16-bit inputs (fp16 under the interpreter), so the outputs' rounding is
    checked too (the L2-norm backward rounds into the slab's rows in its kernel)."""
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16 if half else torch.float32
    K = 16 if device == "cpu" else 128
    ins = _inputs(lengths, H, HV, K, dtype, device)
    monkeypatch.delenv(bwd_slabs.SLAB_ENV, raising=False)
    want, saved = _run(ins, offs, S, l2, h0, dht)
    monkeypatch.setenv(bwd_slabs.SLAB_ENV, str(slab))
    got, _ = _run(ins, offs, S, l2, h0, dht)
    plan = bwd_slabs.plan_slabs(saved.index, slab)
    assert plan is not None and len(plan) >= 2  # the slabs did run
    for n in GRADS:
        a, b = got[n], want[n]
        if b is None:
            assert a is None, n
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.isfinite(b).all(), n  # a comparison of NaNs would prove nothing
        assert torch.equal(a, b), (n, (a.float() - b.float()).abs().max().item())


def test_plan_cuts_whole_units():
    index = ChunkIndex.build([0, 100, 150, 400, 401, 700], "cpu")
    slabs = bwd_slabs.plan_slabs(index, 150)
    assert [(s.t0, s.t1, s.u0, s.u1) for s in slabs] == [(0, 150, 0, 2), (150, 400, 2, 3),
                                                          (400, 700, 3, 5)]
    assert [s.index.offsets for s in slabs] == [(0, 100, 150), (0, 250), (0, 1, 300)]
    assert bwd_slabs.plan_slabs(index, 0) is None  # off
    assert bwd_slabs.plan_slabs(index, 700) is None  # the call fits in one slab
    assert bwd_slabs.plan_slabs(ChunkIndex.build([0, 700], "cpu"), 100) is None  # one unit


@pytest.mark.parametrize("value", ["-1", "many", "1.5"])
def test_bad_setting_raises(monkeypatch, value):
    monkeypatch.setenv(bwd_slabs.SLAB_ENV, value)
    with pytest.raises(ValueError, match=bwd_slabs.SLAB_ENV):
        bwd_slabs.slab_tokens()
