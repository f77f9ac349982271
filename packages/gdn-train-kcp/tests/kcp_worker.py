"""Shared by the tests and the gloo worker processes: cases, inputs, per-rank runs.

Loaded by path (not a test module). A *case* is a dict: ``offsets``,
``boundary``, ``exchange``, ``l2`` and head sizes; :func:`make_inputs`
builds the global tensors from the case's seed, identically in every process.
"""

from __future__ import annotations

import gdn_train_kcp as kcp
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
    return kcp.partition_kcp(case["offsets"], world_size, boundary=case["boundary"])


def run_case(case: dict, context, plan, rank: int) -> dict:
    """One rank's autograd GDN and conv on its shard → outputs and gradients."""
    t = make_inputs(case)
    leaves = {n: shard(t[n], plan, rank).requires_grad_(True)
              for n in ("q", "k", "v", "g", "beta")}
    o = kcp.chunk_gated_delta_rule_kcp(
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")), context=context,
        use_qk_l2norm_in_kernel=case.get("l2", False), exchange=case["exchange"])
    o.backward(shard(t["do"], plan, rank))
    out = {"o": o.detach()}
    out.update({"d" + n: leaves[n].grad for n in leaves})
    x = shard(t["x"], plan, rank).requires_grad_(True)
    w = t["w"].clone().requires_grad_(True)
    b = t["b"].clone().requires_grad_(True)
    y = kcp.causal_conv1d_kcp(x, w, b, context)
    y.backward(shard(t["dy"], plan, rank))
    out.update(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad)
    return out


def run_explicit(case: dict, context, plan, rank: int, workspace=None) -> dict:
    """The explicit forward/backward API (optionally with a workspace)."""
    t = make_inputs(case)
    ins = [shard(t[n], plan, rank) for n in ("q", "k", "v", "g", "beta")]
    o, saved = kcp.chunk_gdn_fwd_kcp(*ins, context, exchange=case["exchange"],
                                         use_qk_l2norm_in_kernel=case.get("l2", False))
    grads = kcp.chunk_gdn_bwd_kcp(saved, shard(t["do"], plan, rank), workspace)
    return {"o": o, **{n: getattr(grads, n) for n in ("dq", "dk", "dv", "dg", "dbeta")}}


def world_checks(rank: int, world_size: int, payload: dict) -> dict:
    """Gloo worker: every case (autograd form, then the explicit API twice through
    one workspace), and the digest-mismatch check."""
    results = []
    for case in payload["cases"]:
        plan = plan_of(case, world_size)
        ctx = kcp.build_context_kcp(plan, rank, conv_kernel_size=CONV_W)
        first = run_case(case, ctx, plan, rank)
        ws = kcp.KCPWorkspace(world_size, case.get("HV", 2), case.get("K", 16),
                                 case.get("V", 16), device="cpu")
        # the explicit API, twice through one workspace: it must agree with the
        # autograd form (within tolerance: this package promises no bits)
        explicit = [run_explicit(case, ctx, plan, rank, ws) for _ in range(2)]
        repeat = all(torch.allclose(first[n], e[n], rtol=1e-5, atol=1e-5) for e in explicit
                     for n in ("o", "dq", "dk", "dv", "dg", "dbeta"))
        results.append({"out": first, "repeat": repeat})
    # a plan mismatch must fail loudly on every rank
    offs = [0, 50] if rank == 0 else [0, 51]
    try:
        kcp.build_context_kcp(kcp.partition_kcp(offs, world_size), rank)
        mismatch = None
    except ValueError as err:
        mismatch = str(err)
    dist.barrier()
    return {"results": results, "mismatch": mismatch}
