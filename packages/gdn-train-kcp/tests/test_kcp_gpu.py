"""GPU tests (``pytest -m gpu``): the Triton path in a simulated world on one GPU."""

from __future__ import annotations

import gdn_train_kcp as kcp
import pytest
import torch
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.suites.gpu_marks import ONE_GPU
from gdn_core.suites.kcp_mode import GRADS
from gdn_core.suites.kcp_mode import relative_error as rel_err
from gdn_core.suites.kcp_run import gpu_inputs as make

pytestmark = ONE_GPU


@pytest.mark.parametrize("exchange", ["allgather", "ring"])
@pytest.mark.parametrize("offsets,world,boundary", [
    ([0, 4096], 4, "chunk"),
    ([0, 700, 701, 3000, 3100, 4000], 3, "even"),
    ([0, 200], 4, "chunk"),
])
def test_simulated_world_matches_single_gpu(offsets, world, boundary, exchange):
    ins = make(offsets)
    o_ref, _, saved = chunk_gdn_fwd(*ins[:5], cu_seqlens=offsets, deterministic=False,
                                    use_qk_l2norm_in_kernel=True)
    g_ref = chunk_gdn_bwd(saved, ins[5], deterministic=False)
    plan = kcp.partition_kcp(offsets, world, boundary=boundary)
    ctxs = kcp.build_simulated_contexts_kcp(plan, device="cuda")
    sh = [[t[:, slice(*plan.token_range(r))].contiguous() for r in range(world)] for t in ins]
    leaves = [[s.requires_grad_(True) for s in xs] for xs in sh[:5]]
    os_ = kcp.chunk_gated_delta_rule_kcp_simulated(*leaves, contexts=ctxs, exchange=exchange,
                                                   use_qk_l2norm_in_kernel=True)
    torch.autograd.backward(os_, sh[5])
    assert rel_err(torch.cat([o.detach() for o in os_], 1), o_ref) < 1e-2
    for xs, n in zip(leaves, GRADS):
        assert rel_err(torch.cat([x.grad for x in xs], 1), getattr(g_ref, n)) < 1e-2, n
