"""One rank of an NCCL world (GPU ``rank``) of the shared NCCL test
(:mod:`gdn_core.suites.kcp_nccl`), on a package's
:class:`~gdn_core.kcp_frontend.KCPAPI`; the packages' worker scripts (loaded by path)
call :func:`nccl_checks` with their API.

A *case* is a dict: ``offsets``, ``boundary`` (and ``segment_size``), ``exchange``,
``seed``, head sizes and ``dtype``; :func:`gdn_core.testkit.kcp_case_inputs` builds
the global tensors identically in every process.
"""

from __future__ import annotations

from typing import Any

import torch

from gdn_core.suites.kcp_mode import GRADS
from gdn_core.testkit import kcp_case_inputs


def plan_of(api: Any, case: dict, world_size: int) -> Any:
    extra = {"segment_size": case["segment_size"]} if case.get("segment_size") else {}
    return api.partition(case["offsets"], world_size, boundary=case["boundary"], **extra)


def nccl_checks(api: Any, rank: int, world_size: int, payload: dict) -> list[dict]:
    """Every case through the autograd form on this rank's shard → CPU tensors.
    (``payload["device"] == "cpu"`` runs the same over gloo, for a dry run.)"""
    if api.deterministic:
        torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda", rank) if payload.get("device", "cuda") == "cuda" else None
    dev = dev or torch.device("cpu")
    out = []
    for case in payload["cases"]:
        plan = plan_of(api, case, world_size)
        ctx = api.build_context(plan, rank, device=dev)  # digest checked over NCCL
        a, b = plan.token_range(rank)
        ins = [t[:, a:b].contiguous() for t in kcp_case_inputs(case, dev)]
        leaves = [t.requires_grad_(True) for t in ins[:5]]
        o = api.autograd(*leaves, context=ctx, use_qk_l2norm_in_kernel=True,
                         exchange=case["exchange"])
        o.backward(ins[5])
        out.append({"o": o.detach().cpu(), **{n: x.grad.cpu() for n, x in zip(GRADS, leaves)}})
    return out
