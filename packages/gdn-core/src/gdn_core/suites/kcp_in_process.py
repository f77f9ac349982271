"""In-process KCP tests: world of one, simulated worlds, validation and mode typing.

A world of one (no process group) and simulated worlds against the single-rank run
of the package's mode (:mod:`gdn_core.compose`, :mod:`gdn_core.conv1d`). What
"matches" means is the package's promise: the deterministic package gives the
single-rank bits in a world of one, repeats its bits through workspaces and gives
ring's bits with allgather; the other one agrees within tolerance
(:func:`gdn_core.suites.kcp_mode.agree`). Validation runs before any communication;
plans, contexts, saved sets and workspaces are typed per mode. Run on a KCP package by
its test module (``from … import *``) with its ``kcp_api`` and ``kcp_package``
fixtures.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from gdn_core.conv1d import causal_conv1d
from gdn_core.kcp.plan import Fragment
from gdn_core.suites.kcp_mode import GRADS, agree, close, kcp_names
from gdn_core.suites.kcp_run import inputs, run_simulated, shards, single_rank
from gdn_core.suites.torch_state import deterministic_algorithms

# the package's calls, by KCPAPI attribute (each also exported under KCPAPI.name)
CALLS = ("partition", "build_context", "update_context", "build_simulated_contexts", "fwd",
         "bwd", "autograd", "fwd_simulated", "bwd_simulated", "autograd_simulated", "conv",
         "conv_simulated")


@pytest.fixture(autouse=True)
def _deterministic_algorithms(kcp_api):
    """The deterministic package's tests under torch's deterministic algorithms."""
    with deterministic_algorithms(kcp_api.deterministic):
        yield


def test_package_exports_the_api_calls(kcp_api, kcp_package):
    """The calls these tests make are the package's public functions."""
    for call in CALLS:
        assert getattr(kcp_package, kcp_api.name(call)) is getattr(kcp_api, call), call
    names = kcp_names(kcp_api.deterministic)
    for cls, name in ((kcp_api.plan_cls, names.plan), (kcp_api.context_cls, names.context),
                      (kcp_api.saved_cls, names.saved),
                      (kcp_api.workspace_cls, names.workspace)):
        assert cls.__name__ == name and getattr(kcp_package, name) is cls, name
    assert kcp_package.Fragment is Fragment


# ------------------------------------------------------------ world of one --


@pytest.mark.parametrize("exchange", ["allgather", "ring"])
@pytest.mark.parametrize("offsets,l2,H,HV", [
    ([0, 100], False, 1, 2),
    ([0, 1, 70, 70, 200], True, 2, 4),
])
def test_world_one_matches_single_rank(kcp_api, exchange, offsets, l2, H, HV):
    """Deterministic package: bitwise."""
    det = kcp_api.deterministic
    ins = inputs(offsets, H=H, HV=HV, l2=l2)
    o_ref, g_ref = single_rank(ins, offsets, det, l2)
    plan = kcp_api.partition(torch.tensor(offsets), 1)
    ctx = kcp_api.build_context(plan, 0)  # no process group at all
    leaves = [t.clone().requires_grad_(True) for t in ins[:5]]
    o = kcp_api.autograd(*leaves, context=ctx, use_qk_l2norm_in_kernel=l2, exchange=exchange)
    o.backward(ins[5])
    agree(det, o, o_ref)
    for leaf, n in zip(leaves, GRADS):
        agree(det, leaf.grad, getattr(g_ref, n), n)
    o2, saved = kcp_api.fwd(*ins[:5], ctx, use_qk_l2norm_in_kernel=l2, exchange=exchange)
    g2 = kcp_api.bwd(saved, ins[5], kcp_api.workspace_cls.for_saved(saved))
    agree(det, o2, o_ref)
    for n in GRADS:
        agree(det, getattr(g2, n), getattr(g_ref, n), n)


def test_world_one_conv_matches_single_rank(kcp_api):
    """Deterministic package: bitwise."""
    det = kcp_api.deterministic
    offsets = [0, 3, 40]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 40, 8, generator=gen)
    w = torch.randn(8, 4, generator=gen)
    b = torch.randn(8, generator=gen)
    dy = torch.randn(1, 40, 8, generator=gen)
    ctx = kcp_api.build_context(kcp_api.partition(offsets, 1), 0, conv_kernel_size=4)
    grads = []
    for fn in ("kcp", "ref"):
        xs, ws, bs = (t.clone().requires_grad_(True) for t in (x, w, b))
        if fn == "kcp":
            y = kcp_api.conv(xs, ws, bs, ctx)
        else:
            y = causal_conv1d(xs, ws, bs, "silu", offsets, deterministic=det)
        y.backward(dy)
        grads.append((y.detach(), xs.grad, ws.grad, bs.grad))
    for a, c in zip(*grads):
        agree(det, a, c)


# -------------------------------------------------------- simulated worlds --


def _random_layouts(n: int, seed: int = 0) -> list[tuple[list[int], int, str]]:
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
def test_simulated_world_matches_single_rank(kcp_api, offsets, world, boundary):
    """Deterministic package: also ring's bits with allgather."""
    ins = inputs(offsets, seed=len(offsets) + world)
    o_ref, g_ref = single_rank(ins, offsets, kcp_api.deterministic)
    plan = kcp_api.partition(offsets, world, boundary=boundary)
    outs = {}
    for exchange in ("allgather", "ring"):
        o, g = run_simulated(kcp_api, ins, plan, exchange)
        close(o, o_ref, "o")
        for n in GRADS:
            close(g[n], getattr(g_ref, n), n)
        outs[exchange] = (o, g)
    if kcp_api.deterministic:
        # both exchanges run the same fold steps: the same bits
        assert torch.equal(outs["allgather"][0], outs["ring"][0])
        for n in GRADS:
            assert torch.equal(outs["allgather"][1][n], outs["ring"][1][n]), n


def test_simulated_autograd_and_conv(kcp_api):
    det = kcp_api.deterministic
    offsets, world = [0, 6, 150, 151, 230], 3
    ins = inputs(offsets, H=2, HV=4, l2=True, seed=3)
    o_ref, g_ref = single_rank(ins, offsets, det, l2=True)
    plan = kcp_api.partition(offsets, world, boundary="even")
    ctxs = kcp_api.build_simulated_contexts(plan, conv_kernel_size=3)
    leaves = [[s.requires_grad_(True) for s in shards(t, plan)] for t in ins[:5]]
    os_ = kcp_api.autograd_simulated(*leaves, contexts=ctxs, use_qk_l2norm_in_kernel=True)
    torch.autograd.backward(os_, shards(ins[5], plan))
    close(torch.cat([o.detach() for o in os_], 1), o_ref)
    for ls, n in zip(leaves, GRADS):
        close(torch.cat([x.grad for x in ls], 1), getattr(g_ref, n), n)

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 230, 8, generator=gen)
    w = torch.randn(8, 3, generator=gen, requires_grad=True)
    dy = torch.randn(1, 230, 8, generator=gen)
    xs = [s.requires_grad_(True) for s in shards(x, plan)]
    ys = kcp_api.conv_simulated(xs, w, None, ctxs, activation=None)
    torch.autograd.backward(ys, shards(dy, plan))
    xr = x.clone().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    yr = causal_conv1d(xr, wr, None, None, offsets, deterministic=det)
    yr.backward(dy)
    close(torch.cat([y.detach() for y in ys], 1), yr.detach())
    close(torch.cat([s.grad for s in xs], 1), xr.grad)
    close(w.grad, wr.grad)


def test_simulated_with_workspaces_repeats(kcp_api):
    """Deterministic package: bitwise repeatable."""
    det = kcp_api.deterministic
    offsets, world = [0, 90, 91, 260], 3
    ins = inputs(offsets, seed=5)
    plan = kcp_api.partition(offsets, world, boundary="even")
    ws = [kcp_api.workspace_cls(world, 2, 16, 16, device="cpu") for _ in range(world)]
    a = run_simulated(kcp_api, ins, plan, "allgather")
    b = run_simulated(kcp_api, ins, plan, "allgather", workspaces=ws)
    c = run_simulated(kcp_api, ins, plan, "allgather", workspaces=ws)
    for o in (b, c):
        agree(det, a[0], o[0])
        for n in GRADS:
            agree(det, a[1][n], o[1][n], n)


def test_float64_simulated_world(kcp_api):
    offsets, world = [0, 70, 140], 3
    ins = inputs(offsets, seed=7, dtype=torch.float64)
    o_ref, g_ref = single_rank(ins, offsets, kcp_api.deterministic)
    o, g = run_simulated(kcp_api, ins, kcp_api.partition(offsets, world, boundary="even"),
                         "ring")
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    # gdn_core's reference backward hands dh0 back in fp32 (its documented dtype),
    # so the state gradients crossing ranks carry fp32 rounding
    for n in GRADS:
        torch.testing.assert_close(g[n], getattr(g_ref, n), rtol=1e-6, atol=1e-6)


# ------------------------------------------------- validation and mode typing --


class _LookAlike:
    """Duck-typed like ``real`` (its attributes), of the class's ``deterministic``."""

    deterministic: bool

    def __init__(self, real: Any) -> None:
        self.__dict__.update(real.__dict__)


def look_alike(name: str, deterministic: bool) -> type:
    """A look-alike class ``name`` of the other package's mode ``deterministic``."""
    return type(name, (_LookAlike,), {"deterministic": deterministic})


@pytest.fixture
def world2_rank0(kcp_api):
    """Rank 0 of a world of two whose executor must never be reached."""
    plan = kcp_api.partition([0, 40, 100], 2, boundary="even")
    ctx = kcp_api.build_simulated_contexts(plan)[0]
    ctx.simulated = False  # pretend to be a distributed rank

    def no_communication():
        raise AssertionError("communication started before validation finished")

    ctx.executor = no_communication
    ins = inputs([0, 40, 100])
    return plan, ctx, [t[:, :50].contiguous() for t in ins]


def test_forward_validates_before_communication(kcp_api, world2_rank0):
    own = kcp_names(kcp_api.deterministic)
    plan, ctx, ins = world2_rank0
    with pytest.raises(ValueError, match="exchange"):
        kcp_api.fwd(*ins[:5], ctx, exchange="tree")
    with pytest.raises(ValueError, match="tokens|cu_seqlens"):
        kcp_api.fwd(*(t[:, :49] for t in ins[:5]), ctx)
    with pytest.raises(ValueError, match=own.context):
        kcp_api.fwd(*ins[:5], object())
    with pytest.raises(ValueError, match=own.context):
        kcp_api.conv(torch.randn(1, 50, 8), torch.randn(8, 4), None, object())


def test_backward_refuses_other_mode_before_communication(kcp_api, world2_rank0):
    own, other = kcp_names(kcp_api.deterministic), kcp_names(not kcp_api.deterministic)
    plan, ctx, ins = world2_rank0
    world = kcp_api.build_simulated_contexts(plan)
    sh = [shards(t, plan) for t in inputs([0, 40, 100])]
    _, saveds = kcp_api.fwd_simulated(*sh[:5], world)
    saved = saveds[0]
    saved.context = ctx  # its executor refuses to run
    do = sh[5][0]
    with pytest.raises(ValueError, match=rf"saved must be a {own.saved} \({own.mode}\), "
                                         rf"got .*LookAlikeSavedSet \({other.mode}\)"):
        kcp_api.bwd(look_alike("LookAlikeSavedSet", not kcp_api.deterministic)(saved), do)
    ws = kcp_api.workspace_cls.for_saved(saved)
    with pytest.raises(ValueError, match=f"workspace must be a {own.workspace}"):
        kcp_api.bwd(saved, do, look_alike("LookAlikeWorkspace", not kcp_api.deterministic)(ws))
    with pytest.raises(ValueError, match="HV"):
        kcp_api.bwd(saved, do, kcp_api.workspace_cls(2, 4, 16, 16, device="cpu"))
    with pytest.raises(ValueError, match="world_size"):
        kcp_api.bwd(saved, do, kcp_api.workspace_cls(3, 2, 16, 16, device="cpu"))
    with pytest.raises(ValueError, match="do must have shape"):
        kcp_api.bwd(saved, do[:, :10])


def test_context_and_plan_typing(kcp_api):
    own = kcp_names(kcp_api.deterministic)
    plan = kcp_api.partition([0, 10], 2)
    with pytest.raises(ValueError, match="process group"):
        kcp_api.build_context(plan, 0)  # world of two without torch.distributed
    with pytest.raises(ValueError, match="rank"):
        kcp_api.build_context(plan, 2)
    with pytest.raises(ValueError, match=own.plan):
        kcp_api.build_context(object(), 0)
    ctx = kcp_api.build_simulated_contexts(plan)[1]
    n = plan.num_tokens(1)
    with pytest.raises(ValueError, match="simulated"):
        kcp_api.fwd(*inputs([0, n])[:5], ctx)
    with pytest.raises(ValueError, match="boundary"):
        kcp_api.partition([0, 10], 2, boundary="tokens")
    with pytest.raises(ValueError, match="non-decreasing"):
        kcp_api.partition([0, 10, 5], 2)


def test_plan_api(kcp_api):
    plan = kcp_api.partition(torch.tensor([0, 100, 101, 300], dtype=torch.int32), 3)
    assert isinstance(plan, kcp_api.plan_cls) and plan.deterministic is kcp_api.deterministic
    starts = [plan.token_range(r) for r in range(3)]
    assert starts[0][0] == 0 and starts[-1][1] == 300
    frags = plan.fragments(1)
    assert frags and all(isinstance(f, Fragment) for f in frags)
    assert plan.digest() == kcp_api.partition([0, 100, 101, 300], 3).digest()
    assert plan.digest() != kcp_api.partition([0, 100, 101, 300], 3, boundary="even").digest()
