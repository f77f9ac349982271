"""GPU tests (``pytest -m gpu``, two or more GPUs): real ranks over NCCL.

One process per GPU (``gdn_core.kcp.testing.run_world(backend="nccl")``, NVLink
multicast off). Every rank's outputs and gradients, gathered, against the
single-GPU path on the same global input, within the bf16 tolerance, for each
boundary policy and both exchanges (issue 6). This package promises values,
not bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gdn_core.kcp.testing import run_world
from gdn_core.testkit import kcp_case_single_device, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs two GPUs (NCCL, one rank per GPU)"),
]

WORKER = Path(__file__).with_name("kcp_nccl_worker.py")
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
SHAPE = dict(H=4, HV=8, K=128, V=128, dtype="bfloat16", seed=0)
CASES = [
    dict(offsets=[0, 3000, 3001, 8192], boundary="segment", segment_size=1024,
         exchange="allgather", **SHAPE),
    dict(offsets=[0, 700, 701, 5000, 8192], boundary="chunk", exchange="ring", **SHAPE),
    dict(offsets=[0, 100, 8192], boundary="doc", exchange="allgather", **SHAPE),
]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_world_matches_single_gpu(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    per_rank = run_world(world, WORKER, "nccl_checks", {"cases": CASES}, backend="nccl",
                         timeout=900)
    for i, case in enumerate(CASES):
        want = kcp_case_single_device(case, torch.device("cuda", 0), deterministic=False)
        for n in NAMES:
            got = torch.cat([r[i][n] for r in per_rank], dim=1)
            err = rel_err(got, want[n])
            assert err < 1e-2, (case["boundary"], case["exchange"], n, err)
