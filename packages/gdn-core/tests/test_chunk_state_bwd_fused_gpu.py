"""The fused reverse state recurrence (``gdn_core.ops.chunk_state_bwd_fused``) on the GPU.

bf16, K = V = 128, T = 4096 packed (uneven documents, one shorter than a chunk), group 1
and 2, with and without ``dht``: ``torch.equal`` to ``chunk_state_bwd(dv_local_bwd(...))``
(the Triton kernels), bitwise repeatable, within 1e-2 (of the largest magnitude) of the
two kernels on fp32 inputs; ``store=False`` / ``need`` giving the stored call's ``dh0``.
Then ``GDN_CORE_FUSED_BWD`` on vs off through the public det API (forward + backward,
unsegmented): every gradient bitwise equal, on the plain call and with the backward's
last phase in slabs.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import max_rel_err, offsets_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D = 128
LENGTHS = [1000, 5, 64, 2000, 63, 964]  # 4096 tokens; 5 and 63: shorter than a chunk
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture(autouse=True)
def _triton_kernels(monkeypatch):
    monkeypatch.delenv("GDN_CORE_GLUON", raising=False)  # the two-kernel path is Triton
    monkeypatch.delenv("GDN_CORE_FUSED_BWD", raising=False)
    monkeypatch.delenv("GDN_CORE_BWD_SLAB_TOKENS", raising=False)


def _problem(H, group, seed=0):
    from gdn_core.ops.cumsum import chunk_cumsum_fwd

    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(LENGTHS)
    T, HV = offs[-1], H * group
    index = ChunkIndex.build(offs, "cuda")
    bf = torch.bfloat16
    q = (torch.randn(T, H, D, generator=gen) * 0.1).to("cuda", bf)
    k = torch.nn.functional.normalize(torch.randn(T, H, D, generator=gen), dim=-1).to("cuda", bf)
    W = (torch.randn(T, HV, D, generator=gen) * 0.05).to("cuda", bf)
    do = torch.randn(T, HV, D, generator=gen).to("cuda", bf)
    G = chunk_cumsum_fwd((-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).cuda(), index)
    dht = torch.randn(len(LENGTHS), HV, D, D, generator=gen).cuda()
    return index, (q, k, W, G, do), dht


def _two_kernels(xs, dht, index, group, scale=D**-0.5):
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.dv_local import dv_local_bwd

    q, k, W, G, do = xs
    dvl = dv_local_bwd(q, k, G, do, scale, index, group)
    return chunk_state_bwd(q, k, W, G, do, dvl, dht, scale, index, group)


def _fused(xs, dht, index, group, scale=D**-0.5, **kw):
    from gdn_core.ops.chunk_state_bwd_fused import chunk_state_bwd_fused

    q, k, W, G, do = xs
    return chunk_state_bwd_fused(q, k, W, G, do, dht, scale, index, group, **kw)


@pytest.mark.parametrize("with_dht", [True, False])
@pytest.mark.parametrize("group", [1, 2])
def test_fused_gives_the_two_kernels_bits(group, with_dht):
    index, xs, dht = _problem(4, group)
    dht = dht if with_dht else None
    got = _fused(xs, dht, index, group)
    two = _two_kernels(xs, dht, index, group)
    for name, a, b in zip(("dh", "dv", "dh0"), got, two):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    for name, a, b in zip(("dh", "dv", "dh0"), got, _fused(xs, dht, index, group)):
        assert torch.equal(a, b), f"{name}: not repeatable"
    ref = _two_kernels([x.float() for x in xs], dht, index, group)  # fp32 (ieee dots)
    for name, a, r in zip(("dh", "dv", "dh0"), got, ref):
        assert max_rel_err(a, r) <= 1e-2, name


def test_fused_first_pass_gives_the_stored_calls_dh0():
    index, xs, dht = _problem(2, 2, seed=1)
    _, _, dh0 = _fused(xs, dht, index, 2)
    need = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.int32, device="cuda")
    buf = torch.full_like(dh0, 7.0)
    _fused(xs, dht, index, 2, store=False, need=need, dh0=buf)
    for n in range(len(LENGTHS)):
        assert torch.equal(buf[n], dh0[n] if need[n] else torch.full_like(dh0[n], 7.0)), n


def _det_grads(group, seed=3):
    det = pytest.importorskip("gdn_det_train")
    from gdn_core.ops.registry import record_launches

    gen = torch.Generator().manual_seed(seed)
    T, H = sum(LENGTHS), 4
    HV = H * group
    bf = torch.bfloat16
    leaves = [torch.randn(1, T, H, D, generator=gen), torch.randn(1, T, H, D, generator=gen),
              torch.randn(1, T, HV, D, generator=gen),
              torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen)) * 0.1,
              torch.rand(1, T, HV, generator=gen)]
    leaves = [x.to("cuda", bf if i != 3 else torch.float32).requires_grad_()
              for i, x in enumerate(leaves)]
    h0 = torch.randn(len(LENGTHS), HV, D, D, generator=gen).cuda().requires_grad_()
    do = torch.randn(1, T, HV, D, generator=gen).to("cuda", bf)
    dht = torch.randn(len(LENGTHS), HV, D, D, generator=gen).cuda()
    # the backward on this thread: record_launches sees only its own thread's launches
    with record_launches() as launches, torch.autograd.set_multithreading_enabled(False):
        o, ht = det.chunk_gated_delta_rule_det(
            *leaves, initial_state=h0, output_final_state=True, cu_seqlens=offsets_of(LENGTHS),
            use_qk_l2norm_in_kernel=True, segment_size=0)
        ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
    grads = dict(zip(GRADS, [x.grad for x in leaves] + [h0.grad]))
    return grads, {x.name.rsplit(".", 1)[-1] for x in launches}


@pytest.mark.parametrize("slabs", [False, True], ids=["whole", "slabs"])
@pytest.mark.parametrize("group", [1, 2])
def test_switch_gives_the_same_gradients_through_the_det_api(group, slabs, monkeypatch):
    """Unsegmented, the whole backward at once (``whole``) or its last phase in slabs of
    ~1000 tokens (``slabs``): with the switch on the fused kernel runs instead of the two."""
    if slabs:
        monkeypatch.setenv("GDN_CORE_BWD_SLAB_TOKENS", "1000")
    want, names = _det_grads(group)
    assert "chunk_state_bwd_fused" not in names
    monkeypatch.setenv("GDN_CORE_FUSED_BWD", "1")
    got, names = _det_grads(group)
    assert "chunk_state_bwd_fused" in names and "dv_local_bwd" not in names
    for n in GRADS:
        a, b = got[n], want[n]
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(a, b), (n, (a.float() - b.float()).abs().max().item())
