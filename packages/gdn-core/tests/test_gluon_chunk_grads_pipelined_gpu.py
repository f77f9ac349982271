"""The persistent Gluon chunk-gradient kernel (``gdn_core.ops.gluon.chunk_grads_pipelined``)
on the GPU: the bits of the one-tile kernel (``chunk_grads.chunk_grads_bwd_gluon``).

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). The problems
of ``test_gluon_chunk_grads_gpu.py`` (packed documents with short last chunks, 32K tokens
in 1 and 8 documents; group 1 and 2; bf16 and fp16; ``dq``/``dk`` as fp32 partials and,
group 1, rounded into the input dtype): every output ``torch.equal`` to the one-tile
kernel's, and — as that kernel is tested — within the project's 16-bit tolerances of the
Triton ``chunk_grads_bwd`` and of autograd of the fp32 stage references; bitwise
repeatable; the same bits whatever the grid (the SM count patched down to 1, 3, 7 CTAs,
so each CTA walks many tiles, short chunks among them); each document's bits the same
launched alone; a NaN in the rows a short chunk's TMA tile reads past its end leaving
the other documents' bits unchanged.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import max_rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# the one-tile kernel's GPU test: its problems, reference and tolerances (helpers only)
_spec = importlib.util.spec_from_file_location(
    "_gluon_chunk_grads_gpu_helpers", Path(__file__).with_name("test_gluon_chunk_grads_gpu.py"))
_g = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_g)

D, TOL, LENGTHS, LONG, NAMES = _g.D, _g.TOL, _g.LENGTHS, _g.LONG, _g.NAMES


def _bufs(final, T, HV, dtype):
    if not final:
        return {}
    return dict(dq=torch.empty(T, HV, D, dtype=dtype, device="cuda"),
                dk=torch.empty(T, HV, D, dtype=dtype, device="cuda"))


def _same(got, want, what):
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {name}"
        assert torch.equal(a, b), f"{what}: {name} differs from the one-tile kernel"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group,final", [(1, False), (1, True), (2, False)],
                         ids=["g1-fp32", "g1-final", "g2-fp32"])
@pytest.mark.parametrize("lengths", [LENGTHS, *LONG], ids=["short", "32k-1doc", "32k-8docs"])
def test_pipelined_bits_equal_the_one_tile_kernel(lengths, group, final, dtype):
    from gdn_core.ops.chunk_grads_bwd import chunk_grads_bwd
    from gdn_core.ops.gluon.chunk_grads import chunk_grads_bwd_gluon
    from gdn_core.ops.gluon.chunk_grads_pipelined import chunk_grads_bwd_gluon_pipelined

    H = 2 if len(lengths) == 4 else 4
    p = _g._problem(lengths, H, group, dtype, seed=31)
    args = p["args"]
    T, HV = args[0].shape[0], H * group

    got = chunk_grads_bwd_gluon_pipelined(*args, **_bufs(final, T, HV, dtype))
    _same(got, chunk_grads_bwd_gluon(*args, **_bufs(final, T, HV, dtype)), "one-tile")
    _same(got, chunk_grads_bwd_gluon_pipelined(*args, **_bufs(final, T, HV, dtype)), "again")
    tri = chunk_grads_bwd(*args, **_bufs(final, T, HV, dtype))
    for name, a, b in zip(NAMES, got, tri):
        assert max_rel_err(a, b) <= TOL[dtype], f"{name}: vs Triton {max_rel_err(a, b):.3e}"
    want = _g._reference(p)
    for name, a, b, w in zip(NAMES, got, tri, want):
        e_gl, e_tr = max_rel_err(a, w), max_rel_err(b, w)
        assert e_gl <= max(TOL[dtype], 1.5 * e_tr), (
            f"{name}: vs fp32 reference {e_gl:.3e} (Triton {e_tr:.3e})")


@pytest.mark.parametrize("sms", [1, 3, 7])
@pytest.mark.parametrize("group", [1, 2])
def test_bits_do_not_depend_on_the_grid(monkeypatch, sms, group):
    """Few CTAs, many tiles each (short chunks and full ones in turn, both groups): the
    prefetch ring is walked through all five rotations and the bits stay the one-tile
    kernel's."""
    from gdn_core.ops.gluon import chunk_grads_pipelined as gp
    from gdn_core.ops.gluon.chunk_grads import chunk_grads_bwd_gluon

    p = _g._problem(LENGTHS + [1, 130, 63], 2, group, torch.bfloat16, seed=7)
    want = chunk_grads_bwd_gluon(*p["args"])
    monkeypatch.setattr(gp, "_num_sms", lambda device: sms)
    _same(gp.chunk_grads_bwd_gluon_pipelined(*p["args"]), want, f"{sms} CTAs")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pipelined_documents_are_independent(monkeypatch, dtype):
    """Each document alone gives the packed launch's bits; NaN in a document's first row
    (which the short chunk before it loads past its end through TMA) stays in that
    document — with 3 CTAs, so a CTA's next tile is often another document's."""
    from gdn_core.ops.gluon import chunk_grads_pipelined as gp

    monkeypatch.setattr(gp, "_num_sms", lambda device: 3)
    run = gp.chunk_grads_bwd_gluon_pipelined
    group = 2
    p = _g._problem(LENGTHS, 2, group, dtype, seed=1)
    offs = p["offs"]
    q, k, v, v_new, h, dh, do, du, G, beta, A_inv, scale, index, _, g_dtype = p["args"]
    full = run(*p["args"])
    c0 = 0
    for d, (bos, eos) in enumerate(_g._bounds(offs)):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        sl, cs = slice(bos, eos), slice(c0, c0 + one.num_chunks)
        alone = run(q[sl], k[sl], v[sl], v_new[sl], h[cs], dh[cs], do[sl], du[sl], G[sl],
                    beta[sl], A_inv[sl], scale, one, group, g_dtype)
        for name, a, b in zip(NAMES, alone, full):
            assert torch.equal(a, b[sl]), f"document {d}: {name}"
        c0 += one.num_chunks

    for d in (1, 3):  # the first row of documents 1 and 3 (read by a short chunk before)
        row = offs[d]
        bad = [x.clone() for x in (q, k, v, v_new, do, du, A_inv)]
        for x in bad:
            x[row] = float("nan")
        bq, bk, bv, bvn, bdo, bdu, ba = bad
        out = run(bq, bk, bv, bvn, h, dh, bdo, bdu, G, beta, ba, scale, index, group, g_dtype)
        for name, a, b in zip(NAMES, out, full):
            assert torch.equal(a[:offs[d]], b[:offs[d]]), f"{name}: NaN in document {d} leaked"
            assert torch.equal(a[offs[d + 1]:], b[offs[d + 1]:]), name
