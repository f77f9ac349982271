"""Ranks that disagree fail at context build, on every rank, within seconds (issue 20).

A real gloo world of two runs :mod:`gdn_core.kcp.agree_checks`: context
builds whose arguments differ between the ranks in one respect each (world
size, rank, boundary, declared heads, head dimensions, dtype, exchange, conv
width), a bad argument or an unusable device on one rank, and a declared
context's calls. Simulated worlds: ranks whose tensors disagree raise
``ValueError``, and declared contexts hold their calls to the declaration.
"""

from __future__ import annotations

import gdn_core.kcp.agree_checks as checks
import gdn_det_train_kcp as kcp
import pytest
import torch
from gdn_core.kcp.testing import run_gloo_world

PACKAGE = "gdn_det_train_kcp"


@pytest.fixture(scope="module")
def outcomes():
    return run_gloo_world(2, checks.__file__, "agreement_scenarios", {"package": PACKAGE},
                          timeout=180)


@pytest.mark.parametrize("name", sorted(checks.DISAGREEMENTS))
def test_disagreement_raises_the_same_error_on_every_rank(outcomes, name):
    checks.check_disagreement(outcomes, name)


def test_a_bad_argument_on_one_rank_stops_every_rank(outcomes):
    checks.check_one_rank_failed(outcomes, "local_error", "conv_kernel_size")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unusable_device_on_one_rank_stops_every_rank(outcomes):
    checks.check_one_rank_failed(outcomes, "device", "CUDA is not available")


def test_calls_are_held_to_the_declaration(outcomes):
    checks.check_calls(outcomes)


def _shards(world: int, dtypes, HVs):
    """Per rank ``(q, k, v, g, beta)`` of an even cut of ``[0, 40, 70]``; rank r in
    ``dtypes[r]`` with ``HVs[r]`` value heads."""
    plan = kcp.partition_det_kcp([0, 40, 70], world, boundary="even")
    shards = []
    for r in range(world):
        n, dt, HV = plan.num_tokens(r), dtypes[r], HVs[r]
        q = torch.randn(1, n, 1, 16, dtype=dt)
        k = torch.nn.functional.normalize(torch.randn(1, n, 1, 16, dtype=dt), dim=-1)
        shards.append((q, k, torch.randn(1, n, HV, 16, dtype=dt), -torch.rand(1, n, HV, dtype=dt),
                       torch.rand(1, n, HV, dtype=dt)))
    return plan, [list(x) for x in zip(*shards)]


@pytest.mark.parametrize("dtypes, HVs", [((torch.float32, torch.float64), (2, 2)),
                                         ((torch.float32, torch.float32), (2, 4))])
def test_simulated_ranks_that_disagree_raise_valueerror(dtypes, HVs):
    plan, ins = _shards(2, dtypes, HVs)
    ctxs = kcp.build_simulated_contexts_det_kcp(plan)
    with pytest.raises(ValueError, match="tensors of one .* differ"):
        kcp.chunk_gdn_det_fwd_kcp_simulated(*ins, ctxs)


def test_simulated_calls_are_held_to_the_declaration():
    plan, ins = _shards(2, (torch.float32,) * 2, (2, 2))
    ctxs = kcp.build_simulated_contexts_det_kcp(plan, heads=(1, 2), head_dims=(16, 16),
                                                dtype=torch.float32, exchange="ring")
    kcp.chunk_gdn_det_fwd_kcp_simulated(*ins, ctxs, exchange="ring")
    with pytest.raises(ValueError, match="declaring exchange='ring'"):
        kcp.chunk_gdn_det_fwd_kcp_simulated(*ins, ctxs)
    ctxs = kcp.build_simulated_contexts_det_kcp(plan, dtype=torch.float64)
    with pytest.raises(ValueError, match="declaring dtype=torch.float64"):
        kcp.chunk_gdn_det_fwd_kcp_simulated(*ins, ctxs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_valueerror():
    plan = kcp.partition_det_kcp([0, 8], 1)
    with pytest.raises(ValueError, match="device='cuda' was given, but CUDA is not available"):
        kcp.build_context_det_kcp(plan, 0, device="cuda")
    with pytest.raises(ValueError, match="device='cuda' was given, but CUDA is not available"):
        kcp.build_simulated_contexts_det_kcp(kcp.partition_det_kcp([0, 8], 2), device="cuda")
