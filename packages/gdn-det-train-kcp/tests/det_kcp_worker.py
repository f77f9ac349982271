"""Gloo worker of the shared world tests (:mod:`gdn_core.suites.kcp_distributed`) and
of test_det_kcp_segment.py, loaded by path: cases, inputs and per-rank runs are
:mod:`gdn_core.suites.kcp_world_cases` on this package's API; the segment checks
against ``gdn_det_train`` (this package's single-rank oracle) are here."""

from __future__ import annotations

import gdn_det_train_kcp as kcp
import torch
import torch.distributed as dist
from gdn_core.suites import kcp_world_cases as cases
from gdn_core.suites.kcp_world_cases import GDN_INPUTS, GDN_OUTPUTS, make_inputs, shard

__all__ = ["GDN_OUTPUTS", "make_inputs", "plan_of", "segment_checks", "shard",
           "simulated_world", "single_rank_det", "world_checks"]

API = kcp.ops.API


def world_checks(rank: int, world_size: int, payload: dict) -> dict:
    return cases.world_checks(API, rank, world_size, payload)


def plan_of(case: dict, world_size: int):
    return cases.plan_of(API, case, world_size)


def single_rank_det(case: dict) -> dict:
    """``gdn_det_train``'s autograd call on the whole global input (the oracle
    the segment plans must reproduce bit for bit)."""
    import gdn_det_train

    t = make_inputs(case)
    leaves = {n: t[n].clone().requires_grad_(True) for n in GDN_INPUTS}
    o, _ = gdn_det_train.chunk_gated_delta_rule_det(
        *(leaves[n] for n in GDN_INPUTS), cu_seqlens=case["offsets"],
        use_qk_l2norm_in_kernel=case.get("l2", False), segment_size=case["segment_size"])
    o.backward(t["do"])
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
        ctx = API.build_context(plan, rank)
        res = {"cuts": plan.cuts, "out": cases.run_gdn(API, case, ctx, plan, rank)}
        if payload.get("explicit"):
            ws = cases.workspace_of(API, case, world_size)
            res["explicit"] = [cases.run_explicit(API, case, ctx, plan, rank, ws)
                               for _ in range(2)]
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
    ranks = cases.simulated_ranks(API, case, world_size)
    return {n: torch.cat([r[n] for r in ranks], dim=1) for n in GDN_OUTPUTS}
