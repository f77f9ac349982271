"""Cases of the KCP world tests, and what one rank runs of them, on a package's
:class:`~gdn_core.kcp_frontend.KCPAPI`.

A *case* is a dict: ``offsets``, ``boundary``, ``exchange``, ``l2``, head sizes and
optionally ``seed`` and ``segment_size``; :func:`make_inputs` builds the global
tensors from the case's seed, identically in every process. The gloo worker
scripts of the packages' tests (loaded by path) call :func:`world_checks` with
their package's API: gdn_core imports no training package.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gdn_core.suites.kcp_run import shard

CONV_W = 4
CONV_D = 8
GDN_INPUTS = ("q", "k", "v", "g", "beta")
GDN_OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta")


def make_inputs(case: dict) -> dict:
    """The case's global tensors: GDN inputs and ``do``, conv ``x, w, b`` and ``dy``."""
    offs = case["offsets"]
    T = offs[-1]
    H, HV, K, V = case.get("H", 1), case.get("HV", 2), case.get("K", 16), case.get("V", 16)
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    if not case.get("l2", False):  # keep the recurrence stable without the in-kernel norm
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -0.3 * torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    do = torch.randn(1, T, HV, V, generator=gen)
    x = torch.randn(1, T, CONV_D, generator=gen)
    w = torch.randn(CONV_D, CONV_W, generator=gen) * 0.5
    b = torch.randn(CONV_D, generator=gen) * 0.1
    dy = torch.randn(1, T, CONV_D, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, do=do, x=x, w=w, b=b, dy=dy)


def plan_of(api: Any, case: dict, world_size: int) -> Any:
    """The case's plan over ``world_size`` ranks (its ``segment_size`` where given)."""
    extra = {}
    if case.get("segment_size") is not None:
        extra["segment_size"] = case["segment_size"]
    return api.partition(case["offsets"], world_size, boundary=case["boundary"], **extra)


def workspace_of(api: Any, case: dict, world_size: int) -> Any:
    """A CPU workspace for the case's head sizes."""
    return api.workspace_cls(world_size, case.get("HV", 2), case.get("K", 16),
                             case.get("V", 16), device="cpu")


def run_gdn(api: Any, case: dict, context: Any, plan: Any, rank: int) -> dict:
    """One rank's differentiable KCP GDN on its shard → output and gradients."""
    t = make_inputs(case)
    leaves = {n: shard(t[n], plan, rank).requires_grad_(True) for n in GDN_INPUTS}
    o = api.autograd(*(leaves[n] for n in GDN_INPUTS), context=context,
                     use_qk_l2norm_in_kernel=case.get("l2", False), exchange=case["exchange"])
    o.backward(shard(t["do"], plan, rank))
    return {"o": o.detach(), **{"d" + n: leaves[n].grad for n in leaves}}


def run_case(api: Any, case: dict, context: Any, plan: Any, rank: int) -> dict:
    """One rank's autograd GDN and conv on its shard → outputs and gradients."""
    out = run_gdn(api, case, context, plan, rank)
    t = make_inputs(case)
    x = shard(t["x"], plan, rank).requires_grad_(True)
    w = t["w"].clone().requires_grad_(True)
    b = t["b"].clone().requires_grad_(True)
    y = api.conv(x, w, b, context)
    y.backward(shard(t["dy"], plan, rank))
    out.update(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad)
    return out


def run_explicit(api: Any, case: dict, context: Any, plan: Any, rank: int,
                 workspace: Any = None) -> dict:
    """The explicit forward/backward calls (optionally with a workspace)."""
    t = make_inputs(case)
    ins = [shard(t[n], plan, rank) for n in GDN_INPUTS]
    o, saved = api.fwd(*ins, context, exchange=case["exchange"],
                       use_qk_l2norm_in_kernel=case.get("l2", False))
    grads = api.bwd(saved, shard(t["do"], plan, rank), workspace)
    return {"o": o, **{n: getattr(grads, n) for n in GDN_OUTPUTS[1:]}}


def simulated_ranks(api: Any, case: dict, world_size: int,
                    workspaces: list | None = None) -> list[dict]:
    """Every rank of the world in this process (explicit calls) → each rank's outputs."""
    plan = plan_of(api, case, world_size)
    t = make_inputs(case)
    ctxs = api.build_simulated_contexts(plan)
    ins = [[shard(t[n], plan, r) for r in range(world_size)] for n in GDN_INPUTS]
    os_, saveds = api.fwd_simulated(*ins, ctxs, exchange=case["exchange"],
                                    use_qk_l2norm_in_kernel=case.get("l2", False))
    grads = api.bwd_simulated(saveds, [shard(t["do"], plan, r) for r in range(world_size)],
                              workspaces)
    return [{"o": o, **{n: getattr(g, n) for n in GDN_OUTPUTS[1:]}} for o, g in zip(os_, grads)]


def world_checks(api: Any, rank: int, world_size: int, payload: dict) -> dict:
    """Gloo worker body: every case of ``payload["cases"]`` (autograd form, then the
    explicit calls twice through one workspace: ``repeat`` says they repeat the
    autograd form — bitwise in the deterministic package, within 1e-5 otherwise),
    and a plan mismatch between the ranks (``mismatch``: its error message)."""
    if api.deterministic:
        torch.use_deterministic_algorithms(True)
    results = []
    for case in payload["cases"]:
        plan = plan_of(api, case, world_size)
        ctx = api.build_context(plan, rank, conv_kernel_size=CONV_W)
        first = run_case(api, case, ctx, plan, rank)
        ws = workspace_of(api, case, world_size)
        explicit = [run_explicit(api, case, ctx, plan, rank, ws) for _ in range(2)]
        if api.deterministic:
            repeat = all(torch.equal(first[n], e[n]) for e in explicit for n in GDN_OUTPUTS)
        else:
            repeat = all(torch.allclose(first[n], e[n], rtol=1e-5, atol=1e-5)
                         for e in explicit for n in GDN_OUTPUTS)
        results.append({"out": first, "repeat": repeat})
    # a plan mismatch must fail loudly on every rank
    offs = [0, 50] if rank == 0 else [0, 51]
    try:
        api.build_context(api.partition(offs, world_size), rank)
        mismatch = None
    except ValueError as err:
        mismatch = str(err)
    dist.barrier()
    return {"results": results, "mismatch": mismatch}
