"""In-process tests: world of one, simulated worlds, validation and mode typing."""

from __future__ import annotations

import random

import gdn_train_kcp as kcp
import pytest
import torch
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.conv1d import causal_conv1d

GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def inputs(offsets, H=1, HV=2, K=16, V=16, seed=0, l2=False, dtype=torch.float32,
           device="cpu"):
    T = offsets[-1]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    if not l2:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -0.3 * torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    do = torch.randn(1, T, HV, V, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta, do)]


def single_rank(ins, offsets, l2=False, backend="reference"):
    q, k, v, g, beta, do = ins
    o, _, saved = chunk_gdn_fwd(q, k, v, g, beta, cu_seqlens=offsets, deterministic=False,
                                use_qk_l2norm_in_kernel=l2, backend=backend)
    return o, chunk_gdn_bwd(saved, do, deterministic=False)


def shards(t, plan):
    return [t[:, slice(*plan.token_range(r))].contiguous() for r in range(plan.world_size)]


def run_simulated(ins, plan, exchange, l2=False, backend=None, workspaces=None):
    ctxs = kcp.build_simulated_contexts_kcp(plan, device=ins[0].device)
    sh = [shards(t, plan) for t in ins]
    os_, saveds = kcp.chunk_gdn_fwd_kcp_simulated(*sh[:5], ctxs, exchange=exchange,
                                                      use_qk_l2norm_in_kernel=l2,
                                                      backend=backend)
    grads = kcp.chunk_gdn_bwd_kcp_simulated(saveds, sh[5], workspaces)
    return torch.cat(os_, 1), {n: torch.cat([getattr(g, n) for g in grads], 1) for n in GRADS}


def close(got, want, what=""):
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=what)


# ------------------------------------------------------------ world of one --


@pytest.mark.parametrize("exchange", ["allgather", "ring"])
@pytest.mark.parametrize("offsets,l2,H,HV", [
    ([0, 100], False, 1, 2),
    ([0, 1, 70, 70, 200], True, 2, 4),
])
def test_world_one_matches_single_rank(exchange, offsets, l2, H, HV):
    ins = inputs(offsets, H=H, HV=HV, l2=l2)
    o_ref, g_ref = single_rank(ins, offsets, l2)
    plan = kcp.partition_kcp(torch.tensor(offsets), 1)
    ctx = kcp.build_context_kcp(plan, 0)  # no process group at all
    leaves = [t.clone().requires_grad_(True) for t in ins[:5]]
    o = kcp.chunk_gated_delta_rule_kcp(*leaves, context=ctx, use_qk_l2norm_in_kernel=l2,
                                           exchange=exchange)
    o.backward(ins[5])
    close(o, o_ref)
    for leaf, n in zip(leaves, GRADS):
        close(leaf.grad, getattr(g_ref, n), n)
    o2, saved = kcp.chunk_gdn_fwd_kcp(*ins[:5], ctx, use_qk_l2norm_in_kernel=l2,
                                          exchange=exchange)
    g2 = kcp.chunk_gdn_bwd_kcp(saved, ins[5], kcp.KCPWorkspace.for_saved(saved))
    close(o2, o_ref)
    for n in GRADS:
        close(getattr(g2, n), getattr(g_ref, n), n)


def test_world_one_conv_matches_single_rank():
    offsets = [0, 3, 40]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 40, 8, generator=gen)
    w = torch.randn(8, 4, generator=gen)
    b = torch.randn(8, generator=gen)
    dy = torch.randn(1, 40, 8, generator=gen)
    ctx = kcp.build_context_kcp(kcp.partition_kcp(offsets, 1), 0, conv_kernel_size=4)
    grads = []
    for fn in ("kcp", "ref"):
        xs, ws, bs = (t.clone().requires_grad_(True) for t in (x, w, b))
        if fn == "kcp":
            y = kcp.causal_conv1d_kcp(xs, ws, bs, ctx)
        else:
            y = causal_conv1d(xs, ws, bs, "silu", offsets, deterministic=False)
        y.backward(dy)
        grads.append((y.detach(), xs.grad, ws.grad, bs.grad))
    for a, c in zip(*grads):
        close(a, c)


# -------------------------------------------------------- simulated worlds --


def _random_layouts(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sizes = [1, 2, 5, 17, 63, 64, 65, 100, 150]
        lengths = [rng.choice(sizes) for _ in range(rng.randint(1, 5))]
        offs = [0]
        for length in lengths:
            offs.append(offs[-1] + length)
        out.append((offs, rng.randint(1, 6), rng.choice(["even", "chunk", "doc"])))
    return out


@pytest.mark.parametrize("offsets,world,boundary", _random_layouts(6) + [
    ([0, 200], 4, "chunk"),          # an empty rank inside a document
    ([0, 300], 3, "even"),           # one document over three ranks
    ([0, 2, 5], 4, "chunk"),         # empty ranks, tiny documents
])
def test_simulated_world_matches_single_rank(offsets, world, boundary):
    ins = inputs(offsets, seed=len(offsets) + world)
    o_ref, g_ref = single_rank(ins, offsets)
    plan = kcp.partition_kcp(offsets, world, boundary=boundary)
    outs = {}
    for exchange in ("allgather", "ring"):
        o, g = run_simulated(ins, plan, exchange)
        close(o, o_ref, "o")
        for n in GRADS:
            close(g[n], getattr(g_ref, n), n)
        outs[exchange] = (o, g)



def test_simulated_autograd_and_conv():
    offsets, world = [0, 6, 150, 151, 230], 3
    ins = inputs(offsets, H=2, HV=4, l2=True, seed=3)
    o_ref, g_ref = single_rank(ins, offsets, l2=True)
    plan = kcp.partition_kcp(offsets, world, boundary="even")
    ctxs = kcp.build_simulated_contexts_kcp(plan, conv_kernel_size=3)
    leaves = [[s.requires_grad_(True) for s in shards(t, plan)] for t in ins[:5]]
    os_ = kcp.chunk_gated_delta_rule_kcp_simulated(*leaves, contexts=ctxs,
                                                       use_qk_l2norm_in_kernel=True)
    torch.autograd.backward(os_, shards(ins[5], plan))
    close(torch.cat([o.detach() for o in os_], 1), o_ref)
    for ls, n in zip(leaves, GRADS):
        close(torch.cat([x.grad for x in ls], 1), getattr(g_ref, n), n)

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 230, 8, generator=gen)
    w = torch.randn(8, 3, generator=gen, requires_grad=True)
    dy = torch.randn(1, 230, 8, generator=gen)
    xs = [s.requires_grad_(True) for s in shards(x, plan)]
    ys = kcp.causal_conv1d_kcp_simulated(xs, w, None, ctxs, activation=None)
    torch.autograd.backward(ys, shards(dy, plan))
    xr = x.clone().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    yr = causal_conv1d(xr, wr, None, None, offsets, deterministic=False)
    yr.backward(dy)
    close(torch.cat([y.detach() for y in ys], 1), yr.detach())
    close(torch.cat([s.grad for s in xs], 1), xr.grad)
    close(w.grad, wr.grad)


def test_simulated_with_workspaces():
    offsets, world = [0, 90, 91, 260], 3
    ins = inputs(offsets, seed=5)
    plan = kcp.partition_kcp(offsets, world, boundary="even")
    ws = [kcp.KCPWorkspace(world, 2, 16, 16, device="cpu") for _ in range(world)]
    a = run_simulated(ins, plan, "allgather")
    b = run_simulated(ins, plan, "allgather", workspaces=ws)
    c = run_simulated(ins, plan, "allgather", workspaces=ws)
    for o in (b, c):
        close(a[0], o[0])
        for n in GRADS:
            close(a[1][n], o[1][n], n)


def test_float64_simulated_world():
    offsets, world = [0, 70, 140], 3
    ins = inputs(offsets, seed=7, dtype=torch.float64)
    o_ref, g_ref = single_rank(ins, offsets)
    o, g = run_simulated(ins, kcp.partition_kcp(offsets, world, boundary="even"), "ring")
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    # gdn_core's reference backward hands dh0 back in fp32 (its documented dtype),
    # so the state gradients crossing ranks carry fp32 rounding
    for n in GRADS:
        torch.testing.assert_close(g[n], getattr(g_ref, n), rtol=1e-6, atol=1e-6)


# ------------------------------------------------- validation and mode typing --


class LookAlikeSavedSet:
    """Duck-typed like a saved set of the deterministic package."""

    deterministic = True

    def __init__(self, real):
        self.__dict__.update(real.__dict__)


class LookAlikeWorkspace:
    deterministic = True

    def __init__(self, real):
        self.__dict__.update(real.__dict__)


@pytest.fixture
def world2_rank0():
    """Rank 0 of a world of two whose executor must never be reached."""
    plan = kcp.partition_kcp([0, 40, 100], 2, boundary="even")
    ctx = kcp.build_simulated_contexts_kcp(plan)[0]
    ctx.simulated = False  # pretend to be a distributed rank

    def no_communication():
        raise AssertionError("communication started before validation finished")

    ctx.executor = no_communication
    ins = inputs([0, 40, 100])
    return plan, ctx, [t[:, :50].contiguous() for t in ins]


def test_forward_validates_before_communication(world2_rank0):
    plan, ctx, ins = world2_rank0
    with pytest.raises(ValueError, match="exchange"):
        kcp.chunk_gdn_fwd_kcp(*ins[:5], ctx, exchange="tree")
    with pytest.raises(ValueError, match="tokens|cu_seqlens"):
        kcp.chunk_gdn_fwd_kcp(*(t[:, :49] for t in ins[:5]), ctx)
    with pytest.raises(ValueError, match="KCPContext"):
        kcp.chunk_gdn_fwd_kcp(*ins[:5], object())
    with pytest.raises(ValueError, match="KCPContext"):
        kcp.causal_conv1d_kcp(torch.randn(1, 50, 8), torch.randn(8, 4), None, object())


def test_backward_refuses_other_mode_before_communication(world2_rank0):
    plan, ctx, ins = world2_rank0
    world = kcp.build_simulated_contexts_kcp(plan)
    sh = [shards(t, plan) for t in ins_full()]
    _, saveds = kcp.chunk_gdn_fwd_kcp_simulated(*sh[:5], world)
    saved = saveds[0]
    saved.context = ctx  # its executor refuses to run
    do = sh[5][0]
    with pytest.raises(ValueError, match=r"saved must be a KCPSavedSet \(non-deterministic\), "
                                         r"got .*LookAlikeSavedSet \(deterministic\)"):
        kcp.chunk_gdn_bwd_kcp(LookAlikeSavedSet(saved), do)
    ws = kcp.KCPWorkspace.for_saved(saved)
    with pytest.raises(ValueError, match="workspace must be a KCPWorkspace"):
        kcp.chunk_gdn_bwd_kcp(saved, do, LookAlikeWorkspace(ws))
    with pytest.raises(ValueError, match="HV"):
        kcp.chunk_gdn_bwd_kcp(saved, do, kcp.KCPWorkspace(2, 4, 16, 16, device="cpu"))
    with pytest.raises(ValueError, match="world_size"):
        kcp.chunk_gdn_bwd_kcp(saved, do, kcp.KCPWorkspace(3, 2, 16, 16, device="cpu"))
    with pytest.raises(ValueError, match="do must have shape"):
        kcp.chunk_gdn_bwd_kcp(saved, do[:, :10])


def ins_full():
    return inputs([0, 40, 100])


def test_context_and_plan_typing():
    plan = kcp.partition_kcp([0, 10], 2)
    with pytest.raises(ValueError, match="process group"):
        kcp.build_context_kcp(plan, 0)  # world of two without torch.distributed
    with pytest.raises(ValueError, match="rank"):
        kcp.build_context_kcp(plan, 2)
    with pytest.raises(ValueError, match="KCPPlan"):
        kcp.build_context_kcp(object(), 0)
    ctx = kcp.build_simulated_contexts_kcp(plan)[1]
    n = plan.num_tokens(1)
    with pytest.raises(ValueError, match="simulated"):
        kcp.chunk_gdn_fwd_kcp(*inputs([0, n])[:5], ctx)
    with pytest.raises(ValueError, match="boundary"):
        kcp.partition_kcp([0, 10], 2, boundary="tokens")
    with pytest.raises(ValueError, match="non-decreasing"):
        kcp.partition_kcp([0, 10, 5], 2)


def test_plan_api():
    plan = kcp.partition_kcp(torch.tensor([0, 100, 101, 300], dtype=torch.int32), 3)
    assert isinstance(plan, kcp.KCPPlan) and plan.deterministic is False
    starts = [plan.token_range(r) for r in range(3)]
    assert starts[0][0] == 0 and starts[-1][1] == 300
    frags = plan.fragments(1)
    assert frags and all(isinstance(f, kcp.Fragment) for f in frags)
    assert plan.digest() == kcp.partition_kcp([0, 100, 101, 300], 3).digest()
    assert plan.digest() != kcp.partition_kcp([0, 100, 101, 300], 3, boundary="even").digest()
