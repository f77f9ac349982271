"""The fused backward (``gdn_core.ops.gluon.fused_bwd``: the reverse state recurrence and every
chunk gradient in one warp-specialised launch) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). The claim is
bitwise: a det forward+backward with stage ``fused_bwd`` added to the default stages gives
every gradient (q, k, v, g, β, h0) equal to the default path's (``fused_state`` then the
one-tile ``grads`` kernel), bf16 and fp16, packed documents with short last chunks and an
empty one, with and without segments (the fold's entry states, ``dh0`` over the fold's
buffer), the in-kernel L2 norm (fp32 ``dq``/``dk``), an initial state and the final state's
gradient, one and two value heads per q/k head (the latter through fp32 per-value-head
``dq``/``dk`` and ``group_reduce``, against the summed chunk-gradient kernel); the fused
kernel launched and the two kernels it replaces not. Also: within
tolerance of the fp32 reference, repeatable, documents longest first or in order give the
same bits, and a NaN in one document stays there.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.testkit import max_rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BASE = "grads,wy,fused_fwd,fused_state"
LENGTHS = [1, 63, 64, 0, 65, 200, 777, 130]
TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}


def _inputs(lengths, H, dtype, seed, *, h0: bool, group: int = 1):
    gen = torch.Generator().manual_seed(seed)
    HV = H * group
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    # q, k of unit norm (as a layer's L2 norm leaves them): the delta rule stays bounded
    base = [torch.nn.functional.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1)
            for _ in range(2)] + [torch.randn(1, T, HV, 128, generator=gen)]
    base += [torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen)),
             torch.rand(1, T, HV, generator=gen)]
    base = [x.cuda().to(torch.float32 if i == 3 else dtype) for i, x in enumerate(base)]
    n = len(lengths)
    state = (torch.randn(n, HV, 128, 128, generator=gen) * 0.1).cuda() if h0 else None
    do = torch.randn(1, T, HV, 128, generator=gen).cuda().to(dtype)
    dht = torch.randn(n, HV, 128, 128, generator=gen).cuda() * 0.1
    return cu, base, state, do, dht


def _run(monkeypatch, stages, cu, base, state, do, dht, *, l2norm, segment_size,
         final_state=True):
    from gdn_core.autograd import chunk_gdn_autograd
    from gdn_core.ops import gluon
    from gdn_core.ops.registry import record_launches

    monkeypatch.setenv(gluon.GLUON_ENV, stages)
    leaves = [x.clone().requires_grad_(True) for x in base]
    h0 = None if state is None else state.clone().requires_grad_(True)
    with record_launches() as launches, torch.autograd.set_multithreading_enabled(False):
        o, ht = chunk_gdn_autograd(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
                                   deterministic=True, segment_size=segment_size,
                                   initial_state=h0, output_final_state=final_state)
        loss = (o.float() * do.float()).sum()
        if final_state:
            loss = loss + (ht * dht).sum()
        loss.backward()
    grads = [x.grad for x in leaves] + ([] if h0 is None else [h0.grad])
    return [x.name.rsplit(".", 1)[-1] for x in launches], grads


def _available():
    from gdn_core.ops import gluon

    if not gluon.available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")


CASES = [(s, l2, dt, st, 1) for s in (None, 128) for l2 in (False, True)
         for dt in (torch.bfloat16, torch.float16) for st in (False, True)]
CASES += [(s, l2, torch.bfloat16, True, 2) for s in (None, 128) for l2 in (False, True)]


@pytest.mark.parametrize("segment_size, l2norm, dtype, states, group", CASES)
def test_fused_bwd_is_the_default_path_bitwise(monkeypatch, segment_size, l2norm, dtype,
                                               states, group):
    _available()
    cu, base, state, do, dht = _inputs(LENGTHS, 2, dtype, seed=11, h0=states, group=group)
    kw = dict(l2norm=l2norm, segment_size=segment_size, final_state=states)
    names, got = _run(monkeypatch, BASE + ",fused_bwd", cu, base, state, do, dht, **kw)
    assert names.count("fused_bwd_gluon") == 1, names
    assert not any(x.startswith(("chunk_grads_bwd", "chunk_state_bwd")) for x in names), names
    # the segment path's first pass still runs the fused state kernel (store=False)
    assert names.count("fused_state_bwd_gluon") == (0 if segment_size is None else 1), names
    want_names, want = _run(monkeypatch, BASE, cu, base, state, do, dht, **kw)
    assert any(x.startswith("chunk_grads_bwd_gluon") for x in want_names), want_names
    assert "fused_bwd_gluon" not in want_names
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, i
        assert max_rel_err(a.float(), b.float()) <= TOL[dtype], f"grad {i}: how far"
        assert torch.equal(a, b), f"grad {i} differs from the default path's bits"
    _, again = _run(monkeypatch, BASE + ",fused_bwd", cu, base, state, do, dht, **kw)
    for i, (a, b) in enumerate(zip(got, again, strict=True)):
        assert torch.equal(a, b), f"grad {i} not repeatable"


def test_fused_bwd_matches_the_fp32_reference(monkeypatch):
    """Against the same call in fp32 on the Triton path (``none``), the bf16 tolerance."""
    _available()
    cu, base, state, do, dht = _inputs(LENGTHS, 2, torch.bfloat16, seed=5, h0=True)
    kw = dict(l2norm=True, segment_size=128)
    _, got = _run(monkeypatch, BASE + ",fused_bwd", cu, base, state, do, dht, **kw)
    ref_base = [x.float() for x in base]
    _, ref = _run(monkeypatch, "none", cu, ref_base, state, do.float(), dht, **kw)
    for i, (a, r) in enumerate(zip(got, ref, strict=True)):
        assert max_rel_err(a.float(), r) <= TOL[torch.bfloat16], f"grad {i}"


def test_document_order_keeps_every_bit(monkeypatch):
    """``GDN_CORE_DOC_ORDER`` 0 and 1 (programs in document order, or longest first) give
    the same bits, with more programs than SMs (40 documents × 4 heads)."""
    from gdn_core.switches import DOC_ORDER_ENV

    _available()
    lengths = [64 * n + 5 for n in (3, 40, 1, 17, 9, 33, 2, 12)] * 5
    cu, base, state, do, dht = _inputs(lengths, 4, torch.bfloat16, seed=7, h0=False)
    kw = dict(l2norm=False, segment_size=None, final_state=False)
    monkeypatch.setenv(DOC_ORDER_ENV, "0")
    _, plain = _run(monkeypatch, BASE + ",fused_bwd", cu, base, state, do, dht, **kw)
    monkeypatch.setenv(DOC_ORDER_ENV, "1")
    _, ordered = _run(monkeypatch, BASE + ",fused_bwd", cu, base, state, do, dht, **kw)
    for i, (a, b) in enumerate(zip(plain, ordered, strict=True)):
        assert torch.equal(a, b), f"grad {i}"


def test_nan_in_one_document_stays_there(monkeypatch):
    """NaN in the first row of a document after a short one (which the short chunk's TMA
    tiles load past its end): every other document's gradients keep their bits."""
    _available()
    cu, base, state, do, dht = _inputs(LENGTHS, 2, torch.bfloat16, seed=3, h0=False)
    kw = dict(l2norm=False, segment_size=None, final_state=False)
    _, clean = _run(monkeypatch, BASE + ",fused_bwd", cu, base, state, do, dht, **kw)
    offs = cu.tolist()
    for d in (2, 4, 6):
        bad = [x.clone() for x in base]
        for i in (0, 1, 2):
            bad[i][0, offs[d]] = float("nan")
        _, got = _run(monkeypatch, BASE + ",fused_bwd", cu, bad, state, do, dht, **kw)
        for i, (a, b) in enumerate(zip(got, clean, strict=True)):
            assert torch.equal(a[0, :offs[d]], b[0, :offs[d]]), f"doc {d}, grad {i}, before"
            assert torch.equal(a[0, offs[d + 1]:], b[0, offs[d + 1]:]), f"doc {d}, grad {i}"


def test_results_over_inputs_keep_the_bits(monkeypatch):
    """``GDN_CORE_BWD_ALIAS=0`` (fresh ``dq``/``dv`` buffers) and unset (``dv`` over ``W``,
    ``dq`` over ``v_new``) give the same bits, with packed short documents and segments."""
    from gdn_core.switches import BWD_ALIAS_ENV

    _available()
    cu, base, state, do, dht = _inputs(LENGTHS, 2, torch.bfloat16, seed=9, h0=True)
    kw = dict(l2norm=False, segment_size=128)
    monkeypatch.setenv(BWD_ALIAS_ENV, "0")
    _, fresh = _run(monkeypatch, BASE + ",fused_bwd", cu, base, state, do, dht, **kw)
    monkeypatch.delenv(BWD_ALIAS_ENV)
    _, over = _run(monkeypatch, BASE + ",fused_bwd", cu, base, state, do, dht, **kw)
    for i, (a, b) in enumerate(zip(fresh, over, strict=True)):
        assert torch.equal(a, b), f"grad {i}"


def test_peak_memory_drops(monkeypatch):
    """Forward+backward peak at T=8192, H=HV=4 (bf16, unit q/k, one document in segments of
    4096): ``fused_bwd`` holds neither ``dh`` (2 units of ``[T, HV, 128]`` 16-bit) nor ``dV'``
    (1) and writes ``dv``/``dq`` over ``W``/``v_new``: at least 1.5 units below the default
    path's peak (about 2.25 expected)."""
    from gdn_core.autograd import chunk_gdn_autograd
    from gdn_core.ops import gluon

    _available()
    T, H = 8192, 4
    cu, base, _, do, _ = _inputs([T], H, torch.bfloat16, seed=2, h0=False)
    leaves = [x.requires_grad_(True) for x in base]
    unit = T * H * 128 * 2

    def peak(stages):
        monkeypatch.setenv(gluon.GLUON_ENV, stages)
        for x in leaves:
            x.grad = None
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o, _ = chunk_gdn_autograd(*leaves, cu_seqlens=cu, deterministic=True)
        o.backward(do)
        del o
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    got = {}
    for stages in (BASE, BASE + ",fused_bwd"):
        peak(stages)  # compiles, fills the caches
        got[stages] = peak(stages)
    before, after = got[BASE], got[BASE + ",fused_bwd"]
    print(f"fwd+bwd peak extra: default {before / unit:.2f}, fused_bwd {after / unit:.2f} units")
    assert before - after >= 1.5 * unit
