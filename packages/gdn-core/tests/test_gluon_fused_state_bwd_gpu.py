"""The warp-specialised fused state backward (``gdn_core.ops.gluon.fused_state_bwd``: dv_local
inside the reverse recurrence) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). The claim is
bitwise: ``dh``, ``dV'``, ``dh0`` equal to ``dv_local_bwd`` then ``chunk_state_bwd`` (the
Triton pair and the Gluon pair), bf16 and fp16, packed documents with short last chunks
and an empty one, group 1 and 2, ``dht`` or none; where bits ever differ the test still
reports the fp32 pair's tolerance first (so a failure says how far). Also: bitwise
repeatable, a document alone gives the packed bits, NaN in one document stays there,
``store=False`` + ``need`` and ``dh0`` over ``dht``.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import max_rel_err, state_bwd_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
LENGTHS = [1, 63, 64, 0, 65, 200, 777]
EIGHT = [4096] * 8


def _problem(lengths, H, group, dtype, seed=0):
    from gdn_core.ops.gluon import available

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    return state_bwd_inputs(lengths, H, group, dtype, "cuda", seed=seed, dv_local=False)


SCALE = 128**-0.5


def _pair(xs, dht, index, group, gluon_pair=False, **kw):
    """dv_local_bwd then chunk_state_bwd (Triton, or their Gluon kernels)."""
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.dv_local import dv_local_bwd

    q, k, W, G, do, _ = xs
    dvl_fn, state_fn = dv_local_bwd, chunk_state_bwd
    if gluon_pair:
        from gdn_core.ops.gluon.chunk_state_bwd import chunk_state_bwd_gluon
        from gdn_core.ops.gluon.dv_local import dv_local_bwd_gluon
        dvl_fn, state_fn = dv_local_bwd_gluon, chunk_state_bwd_gluon
    dvl = dvl_fn(q, k, G, do, SCALE, index, group)
    return state_fn(q, k, W, G, do, dvl, dht, SCALE, index, group, dv=dvl, **kw)


def _fused(xs, dht, index, group, **kw):
    from gdn_core.ops.gluon.fused_state_bwd import fused_state_bwd_gluon

    q, k, W, G, do, _ = xs
    return fused_state_bwd_gluon(q, k, W, G, do, dht, SCALE, index, group, **kw)


@pytest.mark.parametrize("with_dht", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, EIGHT], ids=["short", "8docs"])
def test_fused_state_bwd_is_the_pair_bitwise(lengths, group, dtype, with_dht):
    H = 2
    offs, index, xs = _problem(lengths, H, group, dtype)
    dht = xs[5] if with_dht else None
    got = _fused(xs, dht, index, group)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == torch.float32
    ref = _pair([x.float() if x.dtype != torch.float32 else x for x in xs], dht, index, group)
    for name, a, r in zip(("dh", "dv", "dh0"), got, ref):
        assert max_rel_err(a, r) <= TOL[dtype], name  # fp32 pair: how far, if bits differ
    for pair_gluon in (False, True):
        want = _pair(xs, dht, index, group, gluon_pair=pair_gluon)
        for name, a, b in zip(("dh", "dv", "dh0"), got, want):
            assert torch.equal(a, b), f"{name} vs the {'Gluon' if pair_gluon else 'Triton'} pair"
    for a, b in zip(got, _fused(xs, dht, index, group)):
        assert torch.equal(a, b), "not repeatable"


@pytest.mark.parametrize("group", [1, 2])
def test_longest_first_order_keeps_every_bit(monkeypatch, group):
    """``GDN_CORE_DOC_ORDER=1``: the programs take their documents from ``index.doc_order``
    (longest first; here 150 and 300 programs, more than the SMs); ``dh``, ``dV'``, ``dh0`` are
    the bits of document order and of the pair, with ``store=False`` + ``need`` too."""
    from gdn_core.switches import DOC_ORDER_ENV

    lengths = [64 * n + 5 for n in (3, 40, 1, 17, 64, 9, 33, 2, 50, 12)] * 3
    offs, index, xs = _problem(lengths, 5, group, torch.bfloat16, seed=6)
    assert index.doc_order is not None and index.doc_order.tolist() != list(range(len(lengths)))
    dht = xs[5]
    need = (torch.arange(len(lengths), device="cuda") % 3 != 1).to(torch.int32)
    monkeypatch.setenv(DOC_ORDER_ENV, "0")
    plain = _fused(xs, dht, index, group)
    plain_need = _fused(xs, dht, index, group, store=False, need=need)[2]
    monkeypatch.setenv(DOC_ORDER_ENV, "1")
    ordered = _fused(xs, dht, index, group)
    ordered_need = _fused(xs, dht, index, group, store=False, need=need)[2]
    for name, a, b, c in zip(("dh", "dv", "dh0"), ordered, plain, _pair(xs, dht, index, group)):
        assert torch.equal(a, b) and torch.equal(a, c), name
    keep = need.bool()
    assert torch.equal(ordered_need[keep], plain_need[keep])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_state_bwd_documents_are_independent(dtype):
    """Each document alone gives the packed launch's bits; NaN in a document's first row
    (which the short chunk before it loads past its end) stays in that document."""
    group = 2
    offs, index, xs = _problem(LENGTHS, 2, group, dtype, seed=1)
    dht = xs[5]
    dh, dv, dh0 = _fused(xs, dht, index, group)
    c0 = 0
    for d, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        sl = slice(bos, eos)
        if eos > bos:
            part = [x[sl] for x in xs[:5]] + [None]
            dh_d, dv_d, dh0_d = _fused(part, dht[d:d + 1], one, group)
            assert torch.equal(dh_d, dh[c0:c0 + one.num_chunks]), f"document {d}"
            assert torch.equal(dv_d, dv[sl]) and torch.equal(dh0_d[0], dh0[d]), f"document {d}"
        c0 += one.num_chunks
    for d in (2, 5, 6):  # first rows of documents after a short one
        row = offs[d]
        bad = [x.clone() for x in xs]
        for i in (0, 1, 2, 4):
            bad[i][row] = float("nan")
        dh_n, dv_n, dh0_n = _fused(bad, dht, index, group)
        assert torch.equal(dv_n[:offs[d]], dv[:offs[d]]), f"NaN in document {d} leaked back"
        assert torch.equal(dv_n[offs[d + 1]:], dv[offs[d + 1]:])
        others = [n for n in range(len(LENGTHS)) if n != d]
        assert torch.equal(dh0_n[others], dh0[others])


def test_fused_state_bwd_segment_and_aliasing_calls():
    """``store=False`` + ``need`` gives the pair's ``dh0`` for the wanted documents and leaves
    the others' rows; ``dh0`` over ``dht`` gives the same bits."""
    offs, index, xs = _problem(LENGTHS, 2, 2, torch.bfloat16, seed=4)
    dht = xs[5]
    dh, dv, dh0 = _fused(xs, dht, index, 2)
    need = torch.tensor([1, 0, 1, 1, 0, 1, 0], dtype=torch.int32, device="cuda")
    buf = torch.full_like(dh0, 7.0)
    a, b, c = _fused(xs, dht, index, 2, store=False, need=need, dh0=buf)
    assert a is None and b is None and c is buf
    want = _pair(xs, dht, index, 2, store=False, need=need, dh0=torch.full_like(dh0, 7.0))[2]
    assert torch.equal(c, want)
    keep = need.bool()
    assert torch.equal(c[keep], dh0[keep]) and bool((c[~keep] == 7.0).all())
    alias = dht.clone()
    _, _, c2 = _fused(xs, alias, index, 2, dh0=alias)
    assert c2 is alias and torch.equal(c2, dh0)


@pytest.mark.parametrize("group", [1, 2])
def test_first_pass_ring_depth_keeps_every_bit(monkeypatch, group):
    """``store=False`` with the default 3-stage ring gives the 2-stage ring's ``dh0`` (and
    the pair's), with ``need`` too: the depth moves loads, never arithmetic."""
    from gdn_core.ops.gluon import fused_state_bwd as fs

    assert fs.GLUON_FUSED_STATE_FIRST_PASS_STAGES == 3
    offs, index, xs = _problem(EIGHT, 2, group, torch.bfloat16, seed=6)
    dht = xs[5]
    need = torch.tensor([1, 0, 1, 1, 0, 1, 1, 0], dtype=torch.int32, device="cuda")
    for kw in ({}, {"need": need}):
        three = _fused(xs, dht, index, group, store=False, **kw)[2]
        with monkeypatch.context() as m:
            m.setattr(fs, "GLUON_FUSED_STATE_FIRST_PASS_STAGES", 2)
            two = _fused(xs, dht, index, group, store=False, **kw)[2]
        want = _pair(xs, dht, index, group, store=False, **kw)[2]
        rows = need.bool() if kw else slice(None)
        assert torch.equal(three[rows], two[rows]) and torch.equal(three[rows], want[rows])


@pytest.mark.parametrize("segment_size", [None, 128])
def test_fused_state_stage_routes_the_backward(monkeypatch, segment_size):
    """``GDN_CORE_GLUON=fused_state``: a det forward+backward launches the fused kernel and not
    the pair, with the bits of ``dv_local,state_bwd`` (the Gluon pair) and of ``none`` (Triton);
    with segments of 128 tokens in both of the backward's reverse passes (the first pass's
    ``store=False`` + ``need`` summaries, and the last phase)."""
    from gdn_core.autograd import chunk_gdn_autograd
    from gdn_core.ops import gluon
    from gdn_core.ops.registry import record_launches

    if not gluon.available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(3)
    T, H = 777, 2
    cu = torch.tensor([0, 5, 300, T], dtype=torch.int32, device="cuda")
    base = [torch.randn(1, T, H, 128, generator=gen) for _ in range(3)]
    base += [torch.nn.functional.logsigmoid(torch.randn(1, T, H, generator=gen)),
             torch.rand(1, T, H, generator=gen)]
    base = [x.cuda().to(torch.float32 if i == 3 else torch.bfloat16) for i, x in enumerate(base)]
    do = torch.randn(1, T, H, 128, generator=gen).cuda().bfloat16()

    def run(value):
        monkeypatch.setenv(gluon.GLUON_ENV, value)
        leaves = [x.clone().requires_grad_(True) for x in base]
        with record_launches() as launches, torch.autograd.set_multithreading_enabled(False):
            o, _ = chunk_gdn_autograd(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                      deterministic=True, segment_size=segment_size)
            o.backward(do)
        fused = sum(x.name.endswith("fused_state_bwd_gluon") for x in launches)
        return {x.name.rsplit(".", 1)[-1] for x in launches}, [x.grad for x in leaves], fused

    names, got, fused = run("fused_state")
    assert fused == (1 if segment_size is None else 2), names
    assert not {"dv_local_bwd", "chunk_state_bwd"} & names, names
    for value in ("none", "dv_local,state_bwd"):  # Triton chunk grads in all three
        _, want, _ = run(value)
        for a, b in zip(got, want):
            assert torch.equal(a, b), value
