"""The Gluon chunk-output kernel (``gdn_core.ops.gluon.output``) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). Packed
documents with short last chunks, grouped heads, bf16 and fp16: against the fp32
reference of the stage (``reference.chunk_output_ref``, the tolerance of the Triton
kernel's test: fp16 5e-3 relative to the largest |o|; bf16 1e-2, the project's bf16
tolerance), against the Triton kernel, bitwise repeatable, each document's bits the
same when it is launched alone, and a non-finite value in one document's rows (the
rows a short chunk before it reads through TMA) leaving the other documents' bits
unchanged.
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
LENGTHS = [5, 64, 70, 200]
# 32K tokens: one document, and 9 documents with short last chunks (sum 32768)
LONG = [32768], [1, 4095, 63, 8191, 65, 10000, 3000, 7000, 353]


def _problem(lengths, H, group, dtype, seed=0):
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.gluon import available

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, HV, D = offs[-1], H * group, 128
    index = ChunkIndex.build(offs, "cuda")
    q = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    v_new = torch.randn(T, HV, D, generator=gen).to("cuda", dtype)
    h = (torch.randn(index.num_chunks, HV, D, D, generator=gen) * 0.1).to("cuda", dtype)
    g = (-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).cuda()
    G = chunk_cumsum_fwd(g, index)
    return offs, index, (q, k, v_new, h, G)


def _expand(x, group):
    return x.float().repeat_interleave(group, dim=1)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, *LONG], ids=["short", "32k-1doc", "32k-9docs"])
def test_gluon_output_matches_reference_triton_and_repeats(lengths, group, dtype, warps,
                                                           monkeypatch):
    """At the launcher's 4 warps and at 8 (two warpgroups splitting the columns)."""
    from gdn_core.ops.gluon import output as go
    from gdn_core.ops.gluon.output import chunk_output_fwd_gluon
    from gdn_core.ops.output import chunk_output_fwd

    monkeypatch.setattr(go, "GLUON_OUTPUT_WARPS", warps)
    H = 2 if len(lengths) == 4 else 8
    offs, index, (q, k, v_new, h, G) = _problem(lengths, H, group, dtype)
    scale = 128**-0.5
    o = chunk_output_fwd_gluon(q, k, v_new, h, G, scale, index, group)
    assert o.dtype == dtype and o.shape == v_new.shape
    assert torch.equal(o, chunk_output_fwd_gluon(q, k, v_new, h, G, scale, index, group))
    bounds = list(zip(offs[:-1], offs[1:]))
    o_ref = R.chunk_output_ref(_expand(q, group), _expand(k, group), v_new.float(), h.float(),
                               G, scale, bounds)
    assert max_rel_err(o, o_ref) <= TOL[dtype]
    o_tr = chunk_output_fwd(q, k, v_new, h, G, scale, index, group)
    assert max_rel_err(o, o_tr) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_output_documents_are_independent(dtype):
    """Each document alone gives the packed launch's bits; NaN in a document's rows (which
    the short chunk before it loads past its end) stays in that document."""
    from gdn_core.ops.gluon.output import chunk_output_fwd_gluon

    group = 2
    offs, index, (q, k, v_new, h, G) = _problem(LENGTHS, 2, group, dtype, seed=1)
    scale = 0.37
    o = chunk_output_fwd_gluon(q, k, v_new, h, G, scale, index, group)
    c0 = 0
    for d, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        sl = slice(bos, eos)
        o_d = chunk_output_fwd_gluon(q[sl], k[sl], v_new[sl], h[c0:c0 + one.num_chunks],
                                     G[sl], scale, one, group)
        assert torch.equal(o_d, o[sl]), f"document {d}"
        c0 += one.num_chunks

    for d in (1, 3):  # the first row of documents 1 and 3 (read by a short chunk before)
        row = offs[d]
        bad = [x.clone() for x in (q, k, v_new)]
        for x in bad:
            x[row] = float("nan")
        o_n = chunk_output_fwd_gluon(*bad, h, G, scale, index, group)
        assert torch.equal(o_n[:offs[d]], o[:offs[d]]), f"NaN in document {d} leaked backwards"
        assert torch.equal(o_n[offs[d + 1]:], o[offs[d + 1]:])
