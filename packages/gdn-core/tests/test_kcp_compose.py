"""The KCP composition in simulated worlds (both backends) and the exchange protocol."""

from __future__ import annotations

import os

import pytest
import torch
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.kcp import (
    KCPContext,
    KCPGradsBase,
    KCPPlan,
    KCPSavedBase,
    KCPWorkspaceBase,
    build_simulated_contexts,
    kcp_backward_simulated,
    kcp_forward_simulated,
    partition,
)
from gdn_core.kcp.exchange import AllGather, LocalExchange, RingPass, drive, drive_simulated
from gdn_core.suites.kcp_run import inputs as _inputs

GRADS = ("dq", "dk", "dv", "dg", "dbeta")


class Plan(KCPPlan):
    deterministic = True


class Ctx(KCPContext):
    deterministic = True


class Saved(KCPSavedBase):
    deterministic = True


class Grads(KCPGradsBase):
    deterministic = True


class Workspace(KCPWorkspaceBase):
    deterministic = True


def _simulate(ins, plan, exchange, backend, l2=False, workspaces=None):
    ctxs = build_simulated_contexts(plan, device=ins[0].device, plan_cls=Plan, context_cls=Ctx)
    sh = [[t[:, slice(*plan.token_range(r))] for r in range(plan.world_size)] for t in ins]
    os_, saveds = kcp_forward_simulated(*sh[:5], ctxs, deterministic=True, context_cls=Ctx,
                                        saved_cls=Saved, exchange=exchange, backend=backend,
                                        use_qk_l2norm_in_kernel=l2)
    grads = kcp_backward_simulated(saveds, sh[5], workspaces, deterministic=True,
                                   saved_cls=Saved, workspace_cls=Workspace, grads_cls=Grads)
    return torch.cat(os_, 1), {n: torch.cat([getattr(g, n) for g in grads], 1) for n in GRADS}


def _single(ins, offsets, backend, l2=False):
    o, _, saved = chunk_gdn_fwd(*ins[:5], cu_seqlens=offsets, deterministic=True,
                                backend=backend, use_qk_l2norm_in_kernel=l2)
    return o, chunk_gdn_bwd(saved, ins[5], deterministic=True)


@pytest.mark.parametrize("offsets,world,boundary", [
    ([0, 300], 3, "even"),
    ([0, 10, 200, 201, 330], 4, "even"),
    ([0, 200], 4, "chunk"),
    ([0, 130, 260, 400], 2, "doc"),
    ([0, 1000], 8, "chunk"),
])
def test_reference_simulated_world(offsets, world, boundary):
    ins = _inputs(offsets)
    o_ref, g_ref = _single(ins, offsets, "reference")
    plan = partition(offsets, world, boundary=boundary, plan_cls=Plan)
    got = {ex: _simulate(ins, plan, ex, "reference") for ex in ("allgather", "ring")}
    for o, g in got.values():
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        for n in GRADS:
            torch.testing.assert_close(g[n], getattr(g_ref, n), rtol=1e-5, atol=2e-5)
    assert torch.equal(got["allgather"][0], got["ring"][0])
    for n in GRADS:
        assert torch.equal(got["allgather"][1][n], got["ring"][1][n])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernels under the interpreter")
def test_triton_simulated_world_under_interpreter():
    offsets = [0, 10, 100, 101, 150]
    ins = _inputs(offsets, H=1, HV=2, l2=True, seed=1)
    o_ref, g_ref = _single(ins, offsets, "triton", l2=True)
    plan = partition(offsets, 3, boundary="even", plan_cls=Plan)
    o, g = _simulate(ins, plan, "allgather", "triton", l2=True,
                     workspaces=[Workspace(3, 2, 16, 16, device="cpu") for _ in range(3)])
    torch.testing.assert_close(o, o_ref, rtol=2e-5, atol=2e-5)
    for n in GRADS:
        torch.testing.assert_close(g[n], getattr(g_ref, n), rtol=2e-5, atol=5e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernels under the interpreter")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_segment_worlds_with_the_slab_backward(monkeypatch, world):
    """``boundary="segment"`` worlds: the slab backward (``GDN_CORE_BWD_SLAB_TOKENS``, each
    rank's last phase in slabs) gives the bits of the whole-call backward."""
    from gdn_core import bwd_slabs, segment

    offsets = [0, 5, 330, 331, 451]  # 325 tokens: three 128-token segments
    ins = _inputs(offsets, H=1, HV=2, l2=True, seed=3)
    plan = partition(offsets, world, boundary="segment", segment_size=128, plan_cls=Plan)
    monkeypatch.delenv(bwd_slabs.SLAB_ENV, raising=False)
    o_want, g_want = _simulate(ins, plan, "ring", "triton", l2=True)
    monkeypatch.setenv(bwd_slabs.SLAB_ENV, "64")
    ran = []
    real = segment.finish_in_slabs
    monkeypatch.setattr(segment, "finish_in_slabs",
                        lambda bst, slabs, *a: ran.append(len(slabs)) or real(bst, slabs, *a))
    o, g = _simulate(ins, plan, "ring", "triton", l2=True)
    assert ran and min(ran) >= 2  # every rank's last phase ran in slabs
    assert torch.equal(o, o_want)
    for n in GRADS:
        assert torch.equal(g[n], g_want[n]), n


def test_local_exchange_and_protocol_errors():
    ex = LocalExchange()
    t = torch.arange(4.0)
    assert torch.equal(ex(AllGather(t)), t[None])
    carry = torch.zeros(2)
    assert ex(RingPass(carry, lambda c: c + 1)) is carry

    def gen(kind):
        if kind == "gather":
            yield AllGather(torch.ones(1))
        else:
            yield RingPass(torch.zeros(1), lambda c: c)
        return kind

    with pytest.raises(RuntimeError, match="disagree"):
        drive_simulated([gen("gather"), gen("ring")])

    def short():
        return "done"
        yield  # pragma: no cover

    with pytest.raises(RuntimeError, match="disagree"):
        drive_simulated([gen("gather"), short()])
    assert drive(gen("gather"), ex) == "gather"


def test_simulated_ring_order():
    """The ring carries rank to rank in order (reverse: from the last rank down)."""

    def rank_steps(r, reverse):
        got = yield RingPass(torch.full((1,), -1.0), lambda c: c * 10 + r, reverse=reverse)
        return got.item()

    fwd = drive_simulated([rank_steps(r, False) for r in range(4)])
    assert fwd == [-1.0, -10.0, -99.0, -988.0]
    bwd = drive_simulated([rank_steps(r, True) for r in range(3)])
    assert bwd == [-79.0, -8.0, -1.0]
