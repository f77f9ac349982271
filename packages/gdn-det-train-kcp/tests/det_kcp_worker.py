"""Shared by the tests and the gloo worker processes: cases, inputs, per-rank runs.

Loaded by path (not a test module). A *case* is a dict: ``offsets``,
``boundary``, ``exchange``, ``l2`` and head sizes; :func:`make_inputs`
builds the global tensors from the case's seed, identically in every process.
"""

from __future__ import annotations

import gdn_det_train_kcp as kcp
import torch
import torch.distributed as dist

CONV_W = 4
CONV_D = 8


def make_inputs(case: dict) -> dict:
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


def shard(t: torch.Tensor, plan, rank: int) -> torch.Tensor:
    start, stop = plan.token_range(rank)
    return t[:, start:stop].contiguous()


def plan_of(case: dict, world_size: int):
    extra = {}
    if case.get("segment_size") is not None:
        extra["segment_size"] = case["segment_size"]
    return kcp.partition_det_kcp(case["offsets"], world_size, boundary=case["boundary"],
                                 **extra)


def run_case(case: dict, context, plan, rank: int) -> dict:
    """One rank's autograd GDN and conv on its shard → outputs and gradients."""
    t = make_inputs(case)
    leaves = {n: shard(t[n], plan, rank).requires_grad_(True)
              for n in ("q", "k", "v", "g", "beta")}
    o = kcp.chunk_gated_delta_rule_det_kcp(
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")), context=context,
        use_qk_l2norm_in_kernel=case.get("l2", False), exchange=case["exchange"])
    o.backward(shard(t["do"], plan, rank))
    out = {"o": o.detach()}
    out.update({"d" + n: leaves[n].grad for n in leaves})
    x = shard(t["x"], plan, rank).requires_grad_(True)
    w = t["w"].clone().requires_grad_(True)
    b = t["b"].clone().requires_grad_(True)
    y = kcp.causal_conv1d_det_kcp(x, w, b, context)
    y.backward(shard(t["dy"], plan, rank))
    out.update(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad)
    return out


def run_explicit(case: dict, context, plan, rank: int, workspace=None) -> dict:
    """The explicit forward/backward API (optionally with a workspace)."""
    t = make_inputs(case)
    ins = [shard(t[n], plan, rank) for n in ("q", "k", "v", "g", "beta")]
    o, saved = kcp.chunk_gdn_det_fwd_kcp(*ins, context, exchange=case["exchange"],
                                         use_qk_l2norm_in_kernel=case.get("l2", False))
    grads = kcp.chunk_gdn_det_bwd_kcp(saved, shard(t["do"], plan, rank), workspace)
    return {"o": o, **{n: getattr(grads, n) for n in ("dq", "dk", "dv", "dg", "dbeta")}}


def world_checks(rank: int, world_size: int, payload: dict) -> dict:
    """Gloo worker: every case (autograd form, then the explicit API twice through
    one workspace), and the digest-mismatch check."""
    torch.use_deterministic_algorithms(True)
    results = []
    for case in payload["cases"]:
        plan = plan_of(case, world_size)
        ctx = kcp.build_context_det_kcp(plan, rank, conv_kernel_size=CONV_W)
        first = run_case(case, ctx, plan, rank)
        ws = kcp.DetKCPWorkspace(world_size, case.get("HV", 2), case.get("K", 16),
                                 case.get("V", 16), device="cpu")
        # the explicit API, twice through one workspace: a bitwise repeat of the
        # autograd form
        explicit = [run_explicit(case, ctx, plan, rank, ws) for _ in range(2)]
        repeat = all(torch.equal(first[n], e[n]) for e in explicit
                     for n in ("o", "dq", "dk", "dv", "dg", "dbeta"))
        results.append({"out": first, "repeat": repeat})
    # a plan mismatch must fail loudly on every rank
    offs = [0, 50] if rank == 0 else [0, 51]
    try:
        kcp.build_context_det_kcp(kcp.partition_det_kcp(offs, world_size), rank)
        mismatch = None
    except ValueError as err:
        mismatch = str(err)
    dist.barrier()
    return {"results": results, "mismatch": mismatch}


GDN_OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta")


def single_rank_det(case: dict) -> dict:
    """``gdn_det_train``'s autograd call on the whole global input (the oracle
    the segment plans must reproduce bit for bit)."""
    import gdn_det_train

    t = make_inputs(case)
    leaves = {n: t[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    o, _ = gdn_det_train.chunk_gated_delta_rule_det(
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")), cu_seqlens=case["offsets"],
        use_qk_l2norm_in_kernel=case.get("l2", False), segment_size=case["segment_size"])
    o.backward(t["do"])
    return {"o": o.detach(), **{"d" + n: leaves[n].grad for n in leaves}}


def run_gdn_autograd(case: dict, context, plan, rank: int) -> dict:
    """One rank's differentiable KCP GDN on its shard (no conv)."""
    t = make_inputs(case)
    leaves = {n: shard(t[n], plan, rank).requires_grad_(True)
              for n in ("q", "k", "v", "g", "beta")}
    o = kcp.chunk_gated_delta_rule_det_kcp(
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")), context=context,
        use_qk_l2norm_in_kernel=case.get("l2", False), exchange=case["exchange"])
    o.backward(shard(t["do"], plan, rank))
    return {"o": o.detach(), **{"d" + n: leaves[n].grad for n in leaves}}


def segment_checks(rank: int, world_size: int, payload: dict) -> dict:
    """Gloo worker for segment plans: every case through the autograd form (and,
    with ``explicit``, the explicit API through a workspace); with
    ``single_on_rank0``, rank 0 also runs the single-rank oracle in this process
    (the interpreter runs: the parent cannot switch to the interpreter)."""
    torch.use_deterministic_algorithms(True)
    results = []
    singles: dict[str, dict] = {}
    for case in payload["cases"]:
        plan = plan_of(case, world_size)
        ctx = kcp.build_context_det_kcp(plan, rank)
        res = {"cuts": plan.cuts, "out": run_gdn_autograd(case, ctx, plan, rank)}
        if payload.get("explicit"):
            ws = kcp.DetKCPWorkspace(world_size, case.get("HV", 2), case.get("K", 16),
                                     case.get("V", 16), device="cpu")
            res["explicit"] = [run_explicit(case, ctx, plan, rank, ws) for _ in range(2)]
        if rank == 0 and payload.get("single_on_rank0"):
            key = repr({n: case.get(n) for n in ("offsets", "l2", "H", "HV", "K", "V", "seed",
                                                 "segment_size")})
            if key not in singles:  # the exchange does not change the one-rank call
                singles[key] = single_rank_det(case)
            res["single"] = singles[key]
        if rank == 0 and case.get("simulate"):
            res["simulated"] = simulated_world(case, world_size)
        results.append(res)
    dist.barrier()
    return {"results": results}


def simulated_world(case: dict, world_size: int) -> dict:
    """Every rank of the world in this process (explicit API) → gathered outputs."""
    plan = plan_of(case, world_size)
    t = make_inputs(case)
    ctxs = kcp.build_simulated_contexts_det_kcp(plan)
    ins = [[shard(t[n], plan, r) for r in range(world_size)]
           for n in ("q", "k", "v", "g", "beta")]
    os_, saveds = kcp.chunk_gdn_det_fwd_kcp_simulated(
        *ins, ctxs, exchange=case["exchange"], use_qk_l2norm_in_kernel=case.get("l2", False))
    grads = kcp.chunk_gdn_det_bwd_kcp_simulated(
        saveds, [shard(t["do"], plan, r) for r in range(world_size)])
    out = {"o": torch.cat(os_, dim=1)}
    for n in GDN_OUTPUTS[1:]:
        out[n] = torch.cat([getattr(g, n) for g in grads], dim=1)
    return out
