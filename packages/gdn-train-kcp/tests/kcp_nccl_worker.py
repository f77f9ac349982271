"""One rank of an NCCL world (GPU ``rank``), loaded by path by ``test_kcp_nccl.py``.

A *case* is a dict: ``offsets``, ``boundary`` (and ``segment_size``),
``exchange``, ``seed``, head sizes and ``dtype``;
:func:`gdn_core.testkit.kcp_case_inputs` builds the global tensors identically
in every process.
"""

from __future__ import annotations

import gdn_train_kcp as kcp
import torch
from gdn_core.testkit import kcp_case_inputs

GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def plan_of(case: dict, world_size: int):
    extra = {"segment_size": case["segment_size"]} if case.get("segment_size") else {}
    return kcp.partition_kcp(case["offsets"], world_size, boundary=case["boundary"],
                                 **extra)


def nccl_checks(rank: int, world_size: int, payload: dict) -> list[dict]:
    """Every case through the autograd form on this rank's shard → CPU tensors.
    (``payload["device"] == "cpu"`` runs the same over gloo, for a dry run.)"""
    dev = torch.device("cuda", rank) if payload.get("device", "cuda") == "cuda" else None
    dev = dev or torch.device("cpu")
    out = []
    for case in payload["cases"]:
        plan = plan_of(case, world_size)
        ctx = kcp.build_context_kcp(plan, rank, device=dev)  # digest checked over NCCL
        a, b = plan.token_range(rank)
        ins = [t[:, a:b].contiguous() for t in kcp_case_inputs(case, dev)]
        leaves = [t.requires_grad_(True) for t in ins[:5]]
        o = kcp.chunk_gated_delta_rule_kcp(*leaves, context=ctx,
                                               use_qk_l2norm_in_kernel=True,
                                               exchange=case["exchange"])
        o.backward(ins[5])
        out.append({"o": o.detach().cpu(), **{n: x.grad.cpu() for n, x in zip(GRADS, leaves)}})
    return out
