"""gdn_core.kcp.testing.run_world: a world of fresh rank processes (gloo here)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from gdn_core.kcp.nccl import MULTICAST_OFF
from gdn_core.kcp.testing import run_gloo_world, run_world

_WORKER = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist

    def ranks(rank, world_size, payload):
        t = torch.tensor([rank + payload["add"]])
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(out, t)
        env = {k: os.environ.get(k) for k in payload["env"]}
        return {"gathered": torch.cat(out).tolist(), "backend": dist.get_backend(), "env": env}

    def fail(rank, world_size, payload):
        if rank == 1:
            raise RuntimeError("rank one fails on purpose")
        return rank
    """
)


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(_WORKER)
    return path


def test_gloo_world_runs_every_rank_with_multicast_off(worker):
    payload = {"add": 10, "env": sorted(MULTICAST_OFF) + ["GDN_CORE_BACKEND"]}
    res = run_world(3, worker, "ranks", payload)
    assert [r["gathered"] for r in res] == [[10, 11, 12]] * 3
    assert all(r["backend"] == "gloo" for r in res)
    for r in res:
        assert {k: r["env"][k] for k in MULTICAST_OFF} == MULTICAST_OFF
        assert r["env"]["GDN_CORE_BACKEND"] == "reference"
    assert run_gloo_world(2, worker, "ranks", payload)[1]["gathered"] == [10, 11]


def test_a_failing_rank_raises_with_its_output(worker):
    with pytest.raises(RuntimeError, match="rank one fails on purpose"):
        run_world(2, worker, "fail")


def test_bad_backend_and_too_few_gpus(worker):
    with pytest.raises(ValueError, match="backend must be one of"):
        run_world(2, worker, "ranks", backend="mpi")
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"needs {too_many} GPUs"):
        run_world(too_many, worker, "ranks", backend="nccl")
