"""The backward's one-launch recompute (``gdn_core.ops.gluon.recompute``) on the GPU.

Runs only where Triton 3.6's Gluon imports and the GPU is sm_90 (the H200). Against the
pair it replaces — :func:`~gdn_core.ops.wy.wy_apply` then
:func:`~gdn_core.ops.chunk_state.chunk_state_fwd` with ``store_states`` — on the same
inputs (the forward's 16-bit inverse from :func:`~gdn_core.ops.wy.wy_fwd`): ``W``, ``h``
and ``v_new`` bitwise equal, for packed documents with short last chunks and an empty one,
group 1 and 2, bf16 and fp16, with entry states (and once without); ``v`` read in place as
a view of a packed projection; bitwise repeatable; a NaN in one document's rows (which the
short chunk before it reads through TMA) staying in that document. Then the deterministic
API by default (the stage is a default) against the pair it replaces: outputs and every
gradient bitwise equal, and the kernel ran.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import offsets_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = [1, 63, 64, 65, 0, 200, 777]
D = 128


def _problem(lengths, H, group, dtype, seed=0, nan_row=None):
    """``(offsets, index, (k, v, beta, G, A_inv), h0)`` on the GPU; ``A_inv`` the forward's
    16-bit inverse. ``nan_row``: a token whose k and v rows are NaN."""
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.gluon import available
    from gdn_core.ops.wy import wy_fwd

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, HV = offs[-1], H * group
    index = ChunkIndex.build(offs, "cuda")
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    v = torch.randn(T, HV, D, generator=gen).to("cuda", dtype)
    beta = (torch.rand(T, HV, generator=gen) * 0.9 + 0.05).to("cuda", dtype)
    g = (-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).cuda()
    G = chunk_cumsum_fwd(g, index)
    A_inv, _, _ = wy_fwd(k, v, beta, G, index, group, A_inv_for_backward=True)
    h0 = (torch.randn(len(lengths), HV, D, D, generator=gen) * 0.5).cuda()
    if nan_row is not None:
        k[nan_row] = float("nan")
        v[nan_row] = float("nan")
    return offs, index, (k, v, beta, G, A_inv), h0


def _pair(args, index, group, h0):
    """What the backward runs without the stage: ``(W, h, v_new)``."""
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.wy import wy_apply

    k, v, beta, G, A_inv = args
    W, U = wy_apply(k, v, beta, G, A_inv, index, group)
    h, v_new, _ = chunk_state_fwd(k, W, U, G, index, group, initial_state=h0,
                                  output_final_state=False, store_states=True)
    return W, h, v_new


def _gluon(args, index, group, h0):
    from gdn_core.ops.gluon.recompute import chunk_recompute_gluon

    return chunk_recompute_gluon(*args, index, group, initial_state=h0)


def _equal(got, want, names=("W", "h", "v_new")):
    for name, a, b in zip(names, got, want):
        assert torch.equal(a, b), f"{name}: max|diff| {(a.float() - b.float()).abs().max():.3e}"


# (dtype, group, entry states): every dtype and group with h0, and one without
CASES = [(torch.bfloat16, 1, True), (torch.bfloat16, 2, True), (torch.float16, 1, True),
         (torch.float16, 2, True), (torch.bfloat16, 1, False)]


@pytest.mark.parametrize("dtype, group, use_h0", CASES,
                         ids=["bf16-g1-h0", "bf16-g2-h0", "fp16-g1-h0", "fp16-g2-h0", "bf16-g1"])
def test_gluon_recompute_matches_the_pair_bitwise(dtype, group, use_h0):
    _, index, args, h0 = _problem(LENGTHS, 2, group, dtype)
    h0 = h0 if use_h0 else None
    got = _gluon(args, index, group, h0)
    _equal(got, _pair(args, index, group, h0))
    _equal(_gluon(args, index, group, h0), got)  # repeatable


def test_gluon_recompute_reads_a_strided_v_in_place():
    group = 2
    _, index, (k, v, beta, G, A_inv), h0 = _problem(LENGTHS, 2, group, torch.bfloat16, seed=3)
    T, HV, V = v.shape
    proj = torch.cat([torch.zeros(T, 2 * V, dtype=v.dtype, device="cuda"),
                      v.reshape(T, HV * V)], -1)
    view = proj[:, 2 * V:].view(T, HV, V)
    assert not view.is_contiguous()
    want = _gluon((k, v, beta, G, A_inv), index, group, h0)
    _equal(_gluon((k, view, beta, G, A_inv), index, group, h0), want)


def test_a_nan_stays_in_its_document():
    """A NaN in the first row of the document after a short last chunk (which TMA reads
    whole) leaves every other document's W, v_new rows and chunk states as they were."""
    group = 2
    offs, index, args, h0 = _problem(LENGTHS, 2, group, torch.bfloat16, seed=4)
    clean = _gluon(args, index, group, h0)
    bad_doc = 2  # right after a 63-token document, whose short chunk's tiles read its rows
    _, _, nan_args, _ = _problem(LENGTHS, 2, group, torch.bfloat16, seed=4,
                                 nan_row=offs[bad_doc])
    dirty = _gluon(nan_args, index, group, h0)
    chunk_offs = index.doc_chunk_offsets.tolist()
    for d in range(len(LENGTHS)):
        if d == bad_doc:
            continue
        t0, t1 = offs[d], offs[d + 1]
        c0, c1 = chunk_offs[d], chunk_offs[d + 1]
        assert torch.equal(dirty[0][t0:t1], clean[0][t0:t1]), f"W of document {d}"
        assert torch.equal(dirty[2][t0:t1], clean[2][t0:t1]), f"v_new of document {d}"
        assert torch.equal(dirty[1][c0:c1], clean[1][c0:c1]), f"h of document {d}"


@pytest.mark.parametrize("lengths", [[8192], LENGTHS], ids=["1doc-8k-2segments", "packed"])
def test_det_api_with_the_stage_named_keeps_every_bit(lengths, monkeypatch):
    """The public deterministic call (L2 norm, entry and final states) by default (the
    one-launch recompute) against ``GDN_CORE_GLUON`` = the default stages less
    ``recompute`` (the ``wy_apply`` + state pair): ``o``, the final state and every
    gradient bitwise equal, and the default ran the recompute (``wy_apply`` did not)."""
    det = pytest.importorskip("gdn_det_train")
    from gdn_core.ops import gluon
    from gdn_core.ops.registry import record_launches

    if not gluon.available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(5)
    T, H = sum(lengths), 4
    bf = torch.bfloat16
    base = [*(torch.randn(1, T, H, D, generator=gen).to(bf) for _ in range(3)),
            torch.nn.functional.logsigmoid(torch.randn(1, T, H, generator=gen)),
            torch.rand(1, T, H, generator=gen).to(bf),
            torch.randn(len(lengths), H, D, D, generator=gen) * 0.1]
    base = [x.cuda() for x in base]
    do = torch.randn(1, T, H, D, generator=gen).to("cuda", bf)
    dht = torch.randn(len(lengths), H, D, D, generator=gen).cuda()
    cu = torch.tensor(offsets_of(lengths), dtype=torch.int32, device="cuda")

    def run(stages):
        if stages is None:
            monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
        else:
            monkeypatch.setenv(gluon.GLUON_ENV, stages)
        leaves = [x.clone().requires_grad_(True) for x in base]
        q, k, v, g, beta, h0 = leaves
        # record_launches sees this thread only: keep autograd's CUDA backward on it
        with record_launches() as launches, torch.autograd.set_multithreading_enabled(False):
            o, ht = det.chunk_gated_delta_rule_det(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                use_qk_l2norm_in_kernel=True)
            ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
        names = {x.name.rsplit(".", 1)[-1] for x in launches}
        return names, [o.detach(), ht.detach()] + [x.grad for x in leaves]

    names_default, got = run(None)
    # the default stages but fused_state (named, it would skip its program-count rule and
    # run where the default runs the pair: the same bits, another path) and recompute
    names_pair, want = run(",".join(sorted(gluon.DEFAULT_STAGES - {"fused_state", "recompute"})))
    assert "chunk_recompute_gluon" in names_default and "wy_apply" not in names_default, \
        names_default
    assert "chunk_recompute_gluon" not in names_pair and "wy_apply" in names_pair, names_pair
    _equal(got, want, ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"))
