"""The warp-specialised Gluon fused forward (``gdn_core.ops.gluon.fused_fwd``) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). Against the
Triton fused forward (:func:`~gdn_core.ops.chunk_fwd_fused.chunk_fwd_fused`) on the same
inputs: ``o`` and the final state bitwise equal, for packed documents with short last
chunks and an empty one, group 1 and 2, bf16 and fp16, with an initial state (and once
without),
documents in either walk order; bitwise repeatable; each document's bits the same when it
is launched alone; a NaN in one document's rows (which the short chunk before it reads
through TMA) staying in that document.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import offsets_of, state_fwd_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = [1, 63, 64, 65, 0, 200, 777]


def _problem(lengths, H, group, dtype, seed=0):
    """``testkit.state_fwd_inputs`` on the GPU: offsets, the chunk table, ``(q, k, W, U, G)``
    and ``h0``."""
    from gdn_core.ops.gluon import available

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    p = state_fwd_inputs(lengths, H, H * group, 128, 128, dtype, seed=seed)
    offs = offsets_of(lengths)
    args = tuple(p[x].cuda() for x in ("q", "k", "W", "U", "G"))
    return offs, ChunkIndex.build(offs, "cuda"), args, p["h0"].cuda()


def _both(args, index, group, h0):
    from gdn_core.ops.chunk_fwd_fused import chunk_fwd_fused
    from gdn_core.ops.gluon.fused_fwd import chunk_fwd_fused_gluon

    q, k, W, U, G = args
    kw = dict(initial_state=h0, output_final_state=True)
    want = chunk_fwd_fused(q, k, W, U, G, 0.125, index, group, **kw)
    got = chunk_fwd_fused_gluon(q, k, W, U, G, 0.125, index, group, **kw)
    return got, want


# (dtype, group, initial state): every dtype and group with h0, and one without (each case
# compiles its own kernel specialisation: the matrix is kept small)
CASES = [(torch.bfloat16, 1, True), (torch.bfloat16, 2, True), (torch.float16, 1, True),
         (torch.float16, 2, True), (torch.bfloat16, 1, False)]


@pytest.mark.parametrize("dtype, group, use_h0", CASES,
                         ids=["bf16-g1-h0", "bf16-g2-h0", "fp16-g1-h0", "fp16-g2-h0", "bf16-g1"])
def test_gluon_fused_fwd_matches_triton_bitwise(dtype, group, use_h0):
    offs, index, args, h0 = _problem(LENGTHS, 2, group, dtype)
    (o, fin), (o_t, fin_t) = _both(args, index, group, h0 if use_h0 else None)
    assert torch.equal(o, o_t), (o.float() - o_t.float()).abs().max().item()
    assert torch.equal(fin, fin_t), (fin - fin_t).abs().max().item()
    again = _both(args, index, group, h0 if use_h0 else None)[0]
    assert torch.equal(again[0], o) and torch.equal(again[1], fin)


def test_gluon_fused_fwd_walk_order_and_documents_alone(monkeypatch):
    """The bits do not depend on the walk order or on the other documents of the launch,
    and a NaN in a document's first row stays in that document."""
    from gdn_core.ops.gluon.fused_fwd import chunk_fwd_fused_gluon
    from gdn_core.switches import DOC_ORDER_ENV

    group = 2
    offs, index, args, h0 = _problem(LENGTHS, 2, group, torch.bfloat16, seed=1)
    q, k, W, U, G = args
    kw = dict(initial_state=h0, output_final_state=True)
    o, fin = chunk_fwd_fused_gluon(q, k, W, U, G, 0.125, index, group, **kw)
    monkeypatch.setenv(DOC_ORDER_ENV, "0")
    o2, fin2 = chunk_fwd_fused_gluon(q, k, W, U, G, 0.125, index, group, **kw)
    assert torch.equal(o, o2) and torch.equal(fin, fin2)
    monkeypatch.delenv(DOC_ORDER_ENV)
    for d, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        sl = slice(bos, eos)
        od, fd = chunk_fwd_fused_gluon(q[sl], k[sl], W[sl], U[sl], G[sl], 0.125, one, group,
                                       initial_state=h0[d:d + 1], output_final_state=True)
        assert torch.equal(od, o[sl]) and torch.equal(fd[0], fin[d]), f"document {d}"
    for d in (2, 5):  # the first rows read by the short chunks of documents 1 and 3
        row = offs[d]
        bad = [x.clone() for x in (q, k, W, U)]
        for x in bad:
            x[row] = float("nan")
        ob, fb = chunk_fwd_fused_gluon(*bad, G, 0.125, index, group, **kw)
        assert torch.equal(ob[:row], o[:row]), f"NaN in document {d} leaked backwards"
        assert torch.equal(ob[offs[d + 1]:], o[offs[d + 1]:])
        assert torch.equal(fb[:d], fin[:d]) and torch.equal(fb[d + 1:], fin[d + 1:])
