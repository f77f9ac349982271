"""The Gluon state-backward kernel (``gdn_core.ops.gluon.chunk_state_bwd``) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). Packed
documents with short last chunks (and an empty one), grouped heads, bf16 and fp16, with
and without ``dht``: against the fp32 Triton kernel on the same (rounded) inputs
(``dh``, ``dv``, ``dh0`` relative to their largest magnitude: fp16 5e-3, bf16 1e-2) and
against the 16-bit Triton kernel; bitwise repeatable; the same bits at ``BV`` 64 and 128;
each document's bits the same when it is launched alone; NaN in one document's rows (the
rows a short chunk before it reads through TMA) leaving the other documents' bits
unchanged; ``store=False`` / ``need`` (the segment path) and ``dv`` over ``dv_local``,
``dh0`` over ``dht`` (the backward's aliasing) giving the same bits.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import max_rel_err, state_bwd_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
LENGTHS = [5, 64, 0, 70, 200]
# 32K tokens: one document, and 9 documents with short last chunks (sum 32768)
LONG = [32768], [1, 4095, 63, 8191, 65, 10000, 3000, 7000, 353]


def _problem(lengths, H, group, dtype, seed=0):
    from gdn_core.ops.gluon import available

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    return state_bwd_inputs(lengths, H, group, dtype, "cuda", seed=seed, dv_local=True)


def _call(fn, xs, dht, index, group, scale=128**-0.5, **kw):
    q, k, W, G, do, dvl, _ = xs
    return fn(q, k, W, G, do, dvl, dht, scale, index, group, **kw)


@pytest.mark.parametrize("with_dht", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, *LONG], ids=["short", "32k-1doc", "32k-9docs"])
def test_gluon_state_bwd_matches_triton_and_repeats(lengths, group, dtype, with_dht):
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.gluon.chunk_state_bwd import chunk_state_bwd_gluon

    H = 2 if len(lengths) == 5 else 4
    offs, index, xs = _problem(lengths, H, group, dtype)
    dht = xs[6] if with_dht else None
    dh, dv, dh0 = _call(chunk_state_bwd_gluon, xs, dht, index, group)
    assert dh.dtype == dtype and dv.dtype == dtype and dh0.dtype == torch.float32
    again = _call(chunk_state_bwd_gluon, xs, dht, index, group)
    for a, b in zip((dh, dv, dh0), again):
        assert torch.equal(a, b)
    ref = _call(chunk_state_bwd, [x.float() for x in xs], dht, index, group)  # fp32 Triton
    tr = _call(chunk_state_bwd, xs, dht, index, group)  # the 16-bit Triton kernel
    for name, a, r, t in zip(("dh", "dv", "dh0"), (dh, dv, dh0), ref, tr):
        assert max_rel_err(a, r) <= TOL[dtype], name
        assert max_rel_err(a, t) <= TOL[dtype], name
    for n, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        if eos == bos:
            want = dht[n] if with_dht else torch.zeros_like(dh0[n])
            assert torch.equal(dh0[n], want), f"empty document {n}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_state_bwd_bits_do_not_depend_on_bv(dtype, monkeypatch):
    from gdn_core.ops.gluon import chunk_state_bwd as gs

    _, index, xs = _problem(LENGTHS, 2, 2, dtype, seed=2)
    base = _call(gs.chunk_state_bwd_gluon, xs, xs[6], index, 2)
    for bv, stages in ((64, 2), (64, 3), (128, 2)):
        monkeypatch.setattr(gs, "GLUON_STATE_BWD_BV", bv)
        monkeypatch.setattr(gs, "GLUON_STATE_BWD_STAGES", stages)
        for a, b in zip(base, _call(gs.chunk_state_bwd_gluon, xs, xs[6], index, 2)):
            assert torch.equal(a, b), f"BV={bv} STAGES={stages}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_state_bwd_documents_are_independent(dtype):
    """Each document alone gives the packed launch's bits; NaN in a document's first row
    (which the short chunk before it loads past its end) stays in that document."""
    from gdn_core.ops.gluon.chunk_state_bwd import chunk_state_bwd_gluon

    group = 2
    offs, index, xs = _problem(LENGTHS, 2, group, dtype, seed=1)
    dht = xs[6]
    dh, dv, dh0 = _call(chunk_state_bwd_gluon, xs, dht, index, group)
    c0 = 0
    for d, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        sl = slice(bos, eos)
        if eos > bos:
            part = [x[sl] for x in xs[:6]] + [None]
            dh_d, dv_d, dh0_d = _call(chunk_state_bwd_gluon, part, dht[d:d + 1], one, group)
            assert torch.equal(dh_d, dh[c0:c0 + one.num_chunks]), f"document {d}"
            assert torch.equal(dv_d, dv[sl]) and torch.equal(dh0_d[0], dh0[d]), f"document {d}"
        c0 += one.num_chunks

    for d in (1, 4):  # the first row of documents 1 and 4 (read by the short chunks of 0, 3)
        row = offs[d]
        bad = [x.clone() for x in xs]
        for i in (0, 1, 2, 4, 5):
            bad[i][row] = float("nan")
        dh_n, dv_n, dh0_n = _call(chunk_state_bwd_gluon, bad, dht, index, group)
        assert torch.equal(dv_n[:offs[d]], dv[:offs[d]]), f"NaN in document {d} leaked back"
        assert torch.equal(dv_n[offs[d + 1]:], dv[offs[d + 1]:])
        others = [n for n in range(len(LENGTHS)) if n != d]
        assert torch.equal(dh0_n[others], dh0[others])


def test_gluon_state_bwd_segment_and_aliasing_calls():
    """``store=False`` with ``need`` (the segment path's first pass) gives the stored call's
    ``dh0`` for the wanted documents and leaves the others' rows untouched; ``dv`` written
    over ``dv_local`` and ``dh0`` over ``dht`` (the backward's call) give the same bits."""
    from gdn_core.ops.gluon.chunk_state_bwd import chunk_state_bwd_gluon

    offs, index, xs = _problem(LENGTHS, 2, 2, torch.bfloat16, seed=4)
    dht = xs[6]
    dh, dv, dh0 = _call(chunk_state_bwd_gluon, xs, dht, index, 2)
    need = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32, device="cuda")
    buf = torch.full_like(dh0, 7.0)
    r = _call(chunk_state_bwd_gluon, xs, dht, index, 2, store=False, need=need, dh0=buf)
    assert r[0] is None and r[1] is None and r[2].data_ptr() == buf.data_ptr()
    for n in range(len(LENGTHS)):
        want = dh0[n] if need[n] else torch.full_like(dh0[n], 7.0)
        assert torch.equal(buf[n], want), f"document {n}"
    dvl, dht_buf = xs[5].clone(), dht.clone()
    aliased = list(xs)
    aliased[5] = dvl
    dh_a, dv_a, dh0_a = _call(chunk_state_bwd_gluon, aliased, dht_buf, index, 2, dv=dvl,
                              dh0=dht_buf)
    assert dv_a.data_ptr() == dvl.data_ptr() and dh0_a.data_ptr() == dht_buf.data_ptr()
    assert torch.equal(dh_a, dh) and torch.equal(dv_a, dv) and torch.equal(dh0_a, dh0)
