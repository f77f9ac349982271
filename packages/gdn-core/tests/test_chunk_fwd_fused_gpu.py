"""The fused forward last phase (``gdn_core.ops.chunk_fwd_fused``) on the GPU (the H200).

bf16 (and fp16) K = V = 128: packed documents of uneven lengths (an empty one, one shorter
than a chunk, short last chunks) at T = 4096, group 1 and 2, with and without an initial
state — ``o`` and the final state the same bits as ``chunk_output_fwd(chunk_state_fwd(...))``
(on sm_90 the fused kernel's one ``wgmma`` chain over K = 128 is the output kernel's two
chained 64-row blocks), within the project's tolerance of the fp32 reference, bitwise
repeatable, the same bits at other value blocks / stage counts and for a document alone. Then
the public deterministic API with ``GDN_CORE_FUSED_FWD=1`` against ``0`` (and unset, the
default here): a 1-document
T = 8192 call (two segments of 4096) and the packed T = 4096 one — ``o``, the final state and
every gradient the same bits, and the fused kernel did run.
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
LENGTHS = [1, 63, 0, 64, 65, 1000, 2903]  # T = 4096
D = 128


def _problem(lengths, H, group, dtype, seed=0):
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd

    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, HV = offs[-1], H * group
    index = ChunkIndex.build(offs, "cuda")
    q = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    v = torch.randn(T, HV, D, generator=gen).to("cuda", dtype)
    beta = torch.rand(T, HV, generator=gen).to("cuda", dtype)
    g = (-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).cuda()
    G = chunk_cumsum_fwd(g, index)
    _, W, U = wy_fwd(k, v, beta, G, index, group)
    h0 = (torch.randn(len(lengths), HV, D, D, generator=gen) * 0.1).cuda()
    return dict(q=q, k=k, W=W, U=U, G=G, index=index, group=group, offs=offs, h0=h0)


def _fused(p, h0, scale=D ** -0.5):
    from gdn_core.ops.chunk_fwd_fused import chunk_fwd_fused

    return chunk_fwd_fused(p["q"], p["k"], p["W"], p["U"], p["G"], scale, p["index"],
                           p["group"], initial_state=h0, output_final_state=True)


def _two_kernels(p, h0, scale=D ** -0.5):
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.output import chunk_output_fwd

    h, vn, fin = chunk_state_fwd(p["k"], p["W"], p["U"], p["G"], p["index"], p["group"], h0,
                                 output_final_state=True, store_states=True)
    return chunk_output_fwd(p["q"], p["k"], vn, h, p["G"], scale, p["index"], p["group"]), fin


@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no-h0"])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_is_the_two_kernel_path_bitwise(dtype, group, with_h0):
    p = _problem(LENGTHS, 4, group, dtype)
    h0 = p["h0"] if with_h0 else None
    o, fin = _fused(p, h0)
    o2, fin2 = _two_kernels(p, h0)
    assert o.dtype == dtype and fin.dtype == torch.float32
    assert torch.equal(fin, fin2), f"final: max|diff| {(fin - fin2).abs().max().item():.3e}"
    assert torch.equal(o, o2), f"o: max|diff| {(o.float() - o2.float()).abs().max().item():.3e}"
    again = _fused(p, h0)
    assert torch.equal(again[0], o) and torch.equal(again[1], fin)
    bounds = list(zip(p["offs"][:-1], p["offs"][1:]))
    qe, ke = (p[x].float().repeat_interleave(group, dim=1) for x in ("q", "k"))
    h, vn, fin_ref = R.chunk_states_ref(ke, p["W"].float(), p["U"].float(), p["G"], bounds, h0)
    o_ref = R.chunk_output_ref(qe, ke, vn, h, p["G"], D ** -0.5, bounds)
    assert max_rel_err(o, o_ref) <= TOL[dtype] and max_rel_err(fin, fin_ref) <= TOL[dtype]
    d = LENGTHS.index(0)
    assert torch.equal(fin[d], h0[d] if h0 is not None else torch.zeros_like(fin[d]))


@pytest.mark.parametrize("override", [{"BV": 32}, {"num_stages": 2}, {"num_stages": 3},
                                      {"BV": 128, "num_warps": 8}],
                         ids=["BV32", "stages2", "stages3", "BV128-w8"])
def test_fused_bits_do_not_depend_on_the_config(override, monkeypatch):
    from gdn_core.ops import chunk_fwd_fused as fm

    p = _problem(LENGTHS, 4, 2, torch.bfloat16, seed=1)
    base = _fused(p, p["h0"])
    monkeypatch.setattr(fm, "CONFIG_OVERRIDE", override)
    got = _fused(p, p["h0"])
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), override


def test_fused_documents_are_independent():
    p = _problem(LENGTHS, 4, 2, torch.bfloat16, seed=2)
    o, fin = _fused(p, p["h0"])
    for d, (bos, eos) in enumerate(zip(p["offs"][:-1], p["offs"][1:])):
        sl = slice(bos, eos)
        one = dict(p, index=ChunkIndex.build([0, eos - bos], "cuda"),
                   **{x: p[x][sl].contiguous() for x in ("q", "k", "W", "U", "G")})
        o1, f1 = _fused(one, p["h0"][d:d + 1])
        assert torch.equal(o1, o[sl]) and torch.equal(f1[0], fin[d]), f"document {d}"


@pytest.mark.parametrize("gluon_env, fused_name", [
    (None, "chunk_fwd_fused_gluon"),  # the default: the warp-specialised Gluon fused forward
    ("none", "chunk_fwd_fused"),      # Triton everywhere
], ids=["default", "triton"])
@pytest.mark.parametrize("lengths", [[8192], LENGTHS], ids=["1doc-8k-2segments", "packed-4k"])
def test_det_api_switch_on_is_switch_off_bitwise(lengths, gluon_env, fused_name, monkeypatch):
    """The fused forward (the Gluon kernel by default, the Triton one with
    ``GDN_CORE_GLUON=none``) gives the bits of the two kernels it replaces, outputs and
    gradients."""
    det = pytest.importorskip("gdn_det_train")
    from gdn_core import segment
    from gdn_core.ops import gluon
    from gdn_core.ops.registry import record_launches

    if gluon_env is None:
        monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    else:
        monkeypatch.setenv(gluon.GLUON_ENV, gluon_env)

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

    def run():
        leaves = [x.clone().requires_grad_(True) for x in base]
        q, k, v, g, beta, h0 = leaves
        with record_launches() as launches:
            o, ht = det.chunk_gated_delta_rule_det(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                use_qk_l2norm_in_kernel=True)
            ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
        names = {x.name.rsplit(".", 1)[-1] for x in launches}
        return names, [o.detach(), ht.detach()] + [x.grad for x in leaves]

    monkeypatch.setenv(segment.FUSED_FWD_ENV, "0")
    names_off, off = run()
    monkeypatch.setenv(segment.FUSED_FWD_ENV, "1")
    names_on, on = run()
    assert fused_name in names_on and fused_name not in names_off
    assert "chunk_output_fwd" in names_off and "chunk_output_fwd" not in names_on
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), on, off):
        assert torch.equal(a, b), f"{name}: max|diff| {(a.float() - b.float()).abs().max():.3e}"
    assert all(torch.equal(a, b) for a, b in zip(run()[1], on))  # repeatable with it on
    monkeypatch.delenv(segment.FUSED_FWD_ENV)
    names_default, default = run()  # unset: the default for bf16 K = V = 128 is the fused one
    assert fused_name in names_default
    assert all(torch.equal(a, b) for a, b in zip(default, on))
