"""GPU tests (``pytest -m gpu``, two or more GPUs): real ranks over NCCL.

One process per GPU (``gdn_core.kcp.testing.run_world(backend="nccl")``, NVLink
multicast off). Every rank's outputs and gradients, gathered, against the
single-GPU deterministic path on the same global input: **bitwise** for
``boundary="segment"`` plans (the same segment size on one GPU), within the
bf16 tolerance for the other policies; and a second launch of the whole world
gives the same bits (issue 6).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gdn_core.kcp.testing import run_world
from gdn_core.testkit import kcp_case_single_device, rel_err

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs two GPUs (NCCL, one rank per GPU)"),
]

WORKER = Path(__file__).with_name("det_kcp_nccl_worker.py")
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
SHAPE = dict(H=4, HV=8, K=128, V=128, dtype="bfloat16", seed=0)
CASES = [
    # documents of assorted lengths, one spanning ranks, a one-token one
    dict(offsets=[0, 3000, 3001, 8192], boundary="segment", segment_size=1024,
         exchange="allgather", **SHAPE),
    dict(offsets=[0, 3000, 3001, 8192], boundary="segment", segment_size=1024,
         exchange="ring", **SHAPE),
    dict(offsets=[0, 700, 701, 5000, 8192], boundary="chunk", exchange="allgather", **SHAPE),
    dict(offsets=[0, 8192], boundary="even", exchange="ring", **SHAPE),
]


def _single_gpu(case: dict) -> dict:
    """The whole input on GPU 0 through the deterministic single-rank path."""
    return kcp_case_single_device(case, torch.device("cuda", 0), deterministic=True,
                                  segment_size=case.get("segment_size") or 0)


def _gather(per_rank: list[list[dict]], i: int) -> dict:
    return {n: torch.cat([r[i][n] for r in per_rank], dim=1) for n in NAMES}


@pytest.fixture(autouse=True)
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_world_matches_single_gpu_and_repeats(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    payload = {"cases": CASES}
    first = run_world(world, WORKER, "nccl_checks", payload, backend="nccl", timeout=900)
    again = run_world(world, WORKER, "nccl_checks", payload, backend="nccl", timeout=900)
    for i, case in enumerate(CASES):
        got, rep, want = _gather(first, i), _gather(again, i), _single_gpu(case)
        for n in NAMES:
            assert torch.equal(got[n], rep[n]), (case["boundary"], case["exchange"], n)
            if case["boundary"] == "segment":
                assert torch.equal(got[n], want[n]), (case["exchange"], n)
            else:
                err = rel_err(got[n], want[n])
                assert err < 1e-2, (case["boundary"], n, err)
