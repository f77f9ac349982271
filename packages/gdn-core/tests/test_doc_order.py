"""``GDN_CORE_DOC_ORDER``: the kernels that walk one document a program take their documents
longest first (``ChunkIndex.doc_order``, a document-major grid) and give the same bits.

Without a GPU the Triton kernels run under the interpreter (one program after another, so
only the mapping is checked here, not the dispatch order it is for); the fused state
backward's Gluon kernel is checked on the GPU (``test_gluon_fused_state_bwd_gpu.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gdn_core.chunking import ChunkIndex, longest_first, ordered_docs
from gdn_core.ops import chunk_state_fwd
from gdn_core.ops.chunk_fwd_fused import chunk_fwd_fused
from gdn_core.switches import DOC_ORDER_ENV
from gdn_core.testkit import offsets_of, state_fwd_inputs

LENGTHS = [5, 130, 0, 64, 65, 129, 1, 200]  # chunks 1, 3, 0, 1, 2, 3, 1, 4


def test_doc_order_is_longest_first():
    """Every document once, by chunk count, most first, equal counts (and empty documents)
    in document order; built in the index's one host→device copy."""
    index = ChunkIndex.build(offsets_of(LENGTHS), "cpu")
    assert index.doc_order.dtype == torch.int32
    assert index.doc_order.tolist() == [7, 1, 5, 4, 0, 3, 6, 2]
    assert longest_first(index.chunk_offsets) == [7, 1, 5, 4, 0, 3, 6, 2]
    assert longest_first([0]) == []


def test_ordered_docs_follows_the_switch(monkeypatch):
    """Unset and ``1``: the longest-first table; ``0``: none; anything else raises; a
    padded index (no table) gives none either way."""
    index = ChunkIndex.build(offsets_of(LENGTHS), "cpu")
    monkeypatch.delenv(DOC_ORDER_ENV, raising=False)
    assert ordered_docs(index) is index.doc_order
    monkeypatch.setenv(DOC_ORDER_ENV, "0")
    assert ordered_docs(index) is None
    monkeypatch.setenv(DOC_ORDER_ENV, "1")
    assert ordered_docs(index) is index.doc_order
    monkeypatch.setenv(DOC_ORDER_ENV, "yes")
    with pytest.raises(ValueError, match=DOC_ORDER_ENV):
        ordered_docs(index)
    monkeypatch.delenv(DOC_ORDER_ENV, raising=False)
    assert ordered_docs(dataclasses.replace(index, doc_order=None)) is None


def _grids(monkeypatch) -> list[tuple[str, tuple, object]]:
    """Record every interpreted launch's ``(kernel, grid, ORDERED)`` (then run it)."""
    import triton.runtime.interpreter as interp

    log, run = [], interp.InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        log.append((self.fn.__name__, tuple(grid), kwargs.get("ORDERED")))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interp.InterpretedFunction, "run", spy)
    return log


def _problem(H=1, HV=2, K=32, V=32, seed=0):
    p = state_fwd_inputs(LENGTHS, H, HV, K, V, seed=seed)
    return (*(p[n] for n in ("q", "k", "W", "U", "G", "index", "group", "h0")),)


def _det_inputs(lengths, H, D, seed, device="cpu", dtype=torch.float32):
    """Leaves ``q, k, v, g, beta`` (``[1, T, ...]``; g fp32) and ``do`` of a det call."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
            for _ in range(2))
    v, do = torch.randn(1, T, H, D, generator=gen), torch.randn(1, T, H, D, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, generator=gen) + 2.0) * 0.5
    beta = torch.rand(1, T, H, generator=gen)
    leaves = [x.to(device, torch.float32 if i == 3 else dtype)
              for i, x in enumerate((q, k, v, g, beta))]
    return leaves, do.to(device, dtype)


def _det_bits(monkeypatch, value, base, do, lengths, segment_size):
    """Output, final state and every gradient of a det call with ``GDN_CORE_DOC_ORDER``."""
    from gdn_core.autograd import chunk_gdn_autograd

    monkeypatch.setenv(DOC_ORDER_ENV, value)
    leaves = [x.clone().requires_grad_(True) for x in base]
    o, ht = chunk_gdn_autograd(*leaves, cu_seqlens=offsets_of(lengths), deterministic=True,
                               output_final_state=True, segment_size=segment_size)
    o.backward(do)
    return [o.detach(), ht.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("need", [False, True])
def test_state_forward_bits_in_either_order(monkeypatch, need):
    q, k, W, U, G, index, group, h0 = _problem()
    kw = dict(output_final_state=True, store_states=True)
    if need:  # the segment summaries' launch: [E | M] of the flagged documents only
        flags = torch.tensor([1, 3, 0, 2, 3, 0, 1, 3], dtype=torch.int32)
        h0 = None
        kw = dict(output_final_state=True, store_states=False, identity_state=True,
                  state_width=U.shape[-1] + k.shape[-1], store_v_new=False, need=flags)

    def run(value):
        monkeypatch.setenv(DOC_ORDER_ENV, value)
        return chunk_state_fwd(k, W, U, G, index, group, h0, **kw)

    launches = _grids(monkeypatch)
    plain, ordered = run("0"), run("1")
    (_, g0, o0), (_, g1, o1) = launches  # (V/BV, N, HV), then document-major (V/BV, HV, N)
    N, HV = index.num_docs, W.shape[1]
    assert (g0[1:], o0, g1[1:], o1) == ((N, HV), False, (HV, N), True)
    monkeypatch.delenv(DOC_ORDER_ENV)
    chunk_state_fwd(k, W, U, G, index, group, h0, **kw)  # unset: a forward walk, ordered
    assert launches[2][1:] == ((*g1[:1], HV, N), True)
    if not need:
        for a, b in zip(plain, ordered, strict=True):
            assert torch.equal(a, b)
        return
    assert plain[0] is None and ordered[0] is None and plain[1] is None and ordered[1] is None
    VU = U.shape[-1]
    for n, f in enumerate(flags.tolist()):  # what is not asked for stays unwritten
        if f & 1:
            assert torch.equal(plain[2][n, ..., :VU], ordered[2][n, ..., :VU]), n
        if f & 2:
            assert torch.equal(plain[2][n, ..., VU:], ordered[2][n, ..., VU:]), n


def test_fused_forward_bits_in_either_order(monkeypatch):
    q, k, W, U, G, index, group, h0 = _problem(H=2, HV=2, K=32, V=48)

    def run(value):
        monkeypatch.setenv(DOC_ORDER_ENV, value)
        return chunk_fwd_fused(q, k, W, U, G, 0.37, index, group, initial_state=h0,
                               output_final_state=True)

    launches = _grids(monkeypatch)
    for a, b in zip(run("0"), run("1"), strict=True):
        assert torch.equal(a, b)
    monkeypatch.delenv(DOC_ORDER_ENV)
    chunk_fwd_fused(q, k, W, U, G, 0.37, index, group, initial_state=h0)  # unset: ordered
    N, HV = index.num_docs, W.shape[1]
    assert [(g[1:], o) for _, g, o in launches] == [((N, HV), False), ((HV, N), True),
                                                      ((HV, N), True)]


def test_det_call_bits_in_either_order(monkeypatch):
    """A det forward+backward in segments of 64 tokens (summaries, fold, last phase):
    the same output, final state and gradients with the switch off, on and unset."""
    base, do = _det_inputs(LENGTHS, 1, 16, seed=3)
    plain, ordered, unset = (_det_bits(monkeypatch, v, base, do, LENGTHS, 64)
                             for v in ("0", "1", ""))
    for a, b, c in zip(plain, ordered, unset, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gluon_stages", [None, "grads,fused_state", "none"])
def test_det_call_bits_in_either_order_on_the_gpu(monkeypatch, gluon_stages):
    """bf16, K = V = 128, 30 documents in segments of 256 tokens (more programs than SMs in
    the state launches): the det forward+backward gives the same bits with the switch off,
    on and unset, with the default kernels, the fused state backward named, and Triton
    only."""
    from gdn_core.ops import gluon

    if gluon_stages is None:
        monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    else:
        monkeypatch.setenv(gluon.GLUON_ENV, gluon_stages)
    lengths = [64 * n + 7 for n in (3, 40, 1, 17, 12, 9, 33, 2, 20, 6)] * 3
    base, do = _det_inputs(lengths, 4, 128, seed=4, device="cuda", dtype=torch.bfloat16)
    plain, ordered, unset = (_det_bits(monkeypatch, v, base, do, lengths, 256)
                             for v in ("0", "1", ""))
    for a, b, c in zip(plain, ordered, unset, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
