"""The Gluon chunk-state kernel (``gdn_core.ops.gluon.chunk_state``) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). Packed
documents with short last chunks (and an empty one), grouped heads, bf16 and fp16, with
and without an initial state: ``h``, ``v_new`` and the final state against the fp32
reference (``reference.chunk_states_ref``; fp16 5e-3, bf16 1e-2 relative to the largest
value, the project's tolerances) and against the Triton kernel; bitwise repeatable, the
same bits at every BV and ring depth, each document's bits the same when it is launched
alone, and a NaN in one document's first row (which the short chunk before it reads
through TMA) leaving the other documents' bits unchanged.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import max_rel_err, offsets_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
LENGTHS = [5, 64, 0, 70, 200]
LONG = [1, 4095, 63, 8191, 65, 10000, 3000, 7000, 353]  # 32K tokens, short last chunks


def _problem(lengths, H, group, dtype, seed=0):
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.gluon import available
    from gdn_core.ops.wy import wy_fwd

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, HV, D = offs[-1], H * group, 128
    index = ChunkIndex.build(offs, "cuda")
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    v = torch.randn(T, HV, D, generator=gen).to("cuda", dtype)
    beta = torch.rand(T, HV, generator=gen).to("cuda", dtype)
    g = (-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).cuda()
    G = chunk_cumsum_fwd(g, index)
    _, W, U = wy_fwd(k, v, beta, G, index, group)
    h0 = (torch.randn(len(lengths), HV, D, D, generator=gen) * 0.1).cuda()
    return offs, index, (k, W, U, G), h0


def _run(args, index, group, h0, **kw):
    from gdn_core.ops.gluon.chunk_state import chunk_state_fwd_gluon

    k, W, U, G = args
    return chunk_state_fwd_gluon(k, W, U, G, index, group, h0, output_final_state=True, **kw)


@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, LONG], ids=["short", "32k-9docs"])
def test_gluon_state_matches_reference_triton_and_repeats(lengths, group, dtype, with_h0):
    from gdn_core.ops.chunk_state import chunk_state_fwd

    H = 2 if lengths is LENGTHS else 8
    offs, index, args, h0 = _problem(lengths, H, group, dtype)
    h0 = h0 if with_h0 else None
    h, vn, fin = _run(args, index, group, h0)
    k, W, U, G = args
    assert h.dtype == dtype and vn.dtype == dtype and fin.dtype == torch.float32
    assert tuple(h.shape) == (index.num_chunks, k.shape[1] * group, 128, 128)
    again = _run(args, index, group, h0)
    assert all(torch.equal(a, b) for a, b in zip((h, vn, fin), again))
    bounds = list(zip(offs[:-1], offs[1:]))
    ke = k.float().repeat_interleave(group, dim=1)
    ref = R.chunk_states_ref(ke, W.float(), U.float(), G, bounds, h0)
    tri = chunk_state_fwd(k, W, U, G, index, group, h0, output_final_state=True)
    for name, x, r, t in zip(("h", "v_new", "final"), (h, vn, fin), ref, tri):
        assert max_rel_err(x, r) <= TOL[dtype], name
        assert max_rel_err(x, t) <= TOL[dtype], name
    if 0 in lengths:  # an empty document passes its initial state through
        d = lengths.index(0)
        assert torch.equal(fin[d], h0[d] if h0 is not None else torch.zeros_like(fin[d]))

    # optional outputs: the same bits for what is stored
    h2, vn2, f2 = _run(args, index, group, h0, store_states=False)
    assert h2 is None and torch.equal(vn2, vn) and torch.equal(f2, fin)
    h3, vn3, f3 = _run(args, index, group, h0, store_v_new=False)
    assert vn3 is None and torch.equal(h3, h) and torch.equal(f3, fin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_state_bits_do_not_depend_on_block_or_ring(dtype, monkeypatch):
    """BV = 32, 64, 128 and two or three ring slots: the same bits (value columns are
    independent; the ring only changes when tiles arrive)."""
    from gdn_core.ops.gluon import chunk_state as gs

    offs, index, args, h0 = _problem(LENGTHS, 2, 2, dtype, seed=2)
    base = _run(args, index, 2, h0)
    for bv, stages in ((32, 2), (64, 2), (128, 2), (64, 3), (32, 3)):
        monkeypatch.setattr(gs, "GLUON_STATE_BV", bv)
        monkeypatch.setattr(gs, "GLUON_STATE_STAGES", stages)
        out = _run(args, index, 2, h0)
        assert all(torch.equal(a, b) for a, b in zip(base, out)), (bv, stages)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_state_documents_are_independent(dtype):
    """Each document alone gives the packed launch's bits; NaN in a document's first row
    (read by the short chunk before it, past its end) stays in that document."""
    group = 2
    offs, index, args, h0 = _problem(LENGTHS, 2, group, dtype, seed=1)
    h, vn, fin = _run(args, index, group, h0)
    c0 = 0
    for d, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        sl = slice(bos, eos)
        h_d, vn_d, f_d = _run([x[sl] for x in args], one, group, h0[d:d + 1])
        assert torch.equal(f_d[0], fin[d]), f"document {d}"
        assert torch.equal(vn_d, vn[sl]) and torch.equal(h_d, h[c0:c0 + one.num_chunks])
        c0 += one.num_chunks

    for d in (1, 4):  # documents after a short last chunk (5 tokens; 70 tokens)
        row = offs[d]
        bad = [x.clone() for x in args[:3]]
        for x in bad:
            x[row] = float("nan")
        hn, vnn, fn = _run([*bad, args[3]], index, group, h0)
        assert torch.equal(fn[:d], fin[:d]), f"NaN in document {d} leaked backwards"
        assert torch.equal(vnn[:row], vn[:row])
        assert torch.equal(fn[d + 1:], fin[d + 1:]) and torch.equal(vnn[offs[d + 1]:],
                                                                     vn[offs[d + 1]:])
