"""Inputs and runs of the shared in-process KCP suites: random GDN inputs, the
single-rank run of a mode (:mod:`gdn_core.compose`), shards of a plan, and a
simulated world on a package's :class:`~gdn_core.kcp_frontend.KCPAPI`."""

from __future__ import annotations

from typing import Any

import torch

from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.suites.kcp_mode import GRADS
from gdn_core.testkit import kcp_case_inputs


def inputs(offsets: list[int], H: int = 1, HV: int = 2, K: int = 16, V: int = 16,
           seed: int = 0, l2: bool = False, dtype: torch.dtype = torch.float32,
           device: str = "cpu") -> list[torch.Tensor]:
    """``[q, k, v, g, beta, do]`` over ``offsets[-1]`` tokens (``k`` unit-norm unless
    ``l2``: the recurrence stays stable without the in-kernel norm)."""
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


def gpu_inputs(offsets: list[int], H: int = 4, HV: int = 8, K: int = 128, V: int = 128,
               dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    """``[q, k, v, g, beta, do]`` on CUDA in ``dtype``, production-sized heads
    (:func:`gdn_core.testkit.kcp_case_inputs`: log-sigmoid gates, for the in-kernel
    L2 norm)."""
    case = dict(offsets=offsets, H=H, HV=HV, K=K, V=V, seed=seed,
                dtype=str(dtype).removeprefix("torch."))
    return kcp_case_inputs(case, "cuda")


def single_rank(ins: list[torch.Tensor], offsets: list[int], deterministic: bool,
                l2: bool = False, backend: str = "reference") -> tuple[torch.Tensor, Any]:
    """The single-rank forward and backward of mode ``deterministic``: ``(o, grads)``."""
    q, k, v, g, beta, do = ins
    o, _, saved = chunk_gdn_fwd(q, k, v, g, beta, cu_seqlens=offsets,
                                deterministic=deterministic, use_qk_l2norm_in_kernel=l2,
                                backend=backend)
    return o, chunk_gdn_bwd(saved, do, deterministic=deterministic)


def shard(t: torch.Tensor, plan: Any, rank: int) -> torch.Tensor:
    """``t``'s tokens of ``rank`` under ``plan``."""
    start, stop = plan.token_range(rank)
    return t[:, start:stop].contiguous()


def shards(t: torch.Tensor, plan: Any) -> list[torch.Tensor]:
    """``t`` cut into the plan's per-rank token ranges."""
    return [shard(t, plan, r) for r in range(plan.world_size)]


def run_simulated(api: Any, ins: list[torch.Tensor], plan: Any, exchange: str,
                  l2: bool = False, backend: str | None = None,
                  workspaces: list | None = None) -> tuple[torch.Tensor, dict]:
    """Every rank of ``plan``'s world in this process (the explicit calls of ``api``):
    the output and the gradients, gathered over the ranks."""
    ctxs = api.build_simulated_contexts(plan, device=ins[0].device)
    sh = [shards(t, plan) for t in ins]
    os_, saveds = api.fwd_simulated(*sh[:5], ctxs, exchange=exchange,
                                    use_qk_l2norm_in_kernel=l2, backend=backend)
    grads = api.bwd_simulated(saveds, sh[5], workspaces)
    return torch.cat(os_, 1), {n: torch.cat([getattr(g, n) for g in grads], 1) for n in GRADS}
