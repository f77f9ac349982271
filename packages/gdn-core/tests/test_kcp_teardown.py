"""Rank processes release their process group at teardown (the gloo exit -6 of issue 20).

The first call of a ``torch.library`` custom op imports ``torch._dynamo``, which
imports ``torch.distributed.nn.functional``, whose default arguments capture
``group.WORLD`` at import; a failing rank's traceback holds its frames. Either
kept the group alive past ``destroy_process_group()`` into interpreter
finalisation. Each rank here reports, at exit, whether its group is still alive.
"""

from __future__ import annotations

import re
import textwrap

import pytest
from gdn_core.kcp.testing import run_gloo_world

_WORKER = textwrap.dedent(
    """
    import atexit, os, weakref
    import torch
    import torch.distributed as dist

    @torch.library.custom_op("gdn_teardown_probe::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def _watch(payload, rank):
        ref = weakref.ref(dist.group.WORLD)
        path = os.path.join(payload["dir"], f"rank{rank}")

        def report():
            with open(path, "w") as f:
                f.write("alive" if ref() is not None else "released")

        atexit.register(report)

    def uses_custom_op(rank, world_size, payload):
        _watch(payload, rank)
        return double(torch.ones(2)).tolist()

    KEPT = []  # what a script keeps to its end: the context and its rank's output

    def keeps_a_context(rank, world_size, payload):
        from gdn_core.kcp import KCPContext, KCPPlan, build_context, partition

        class Plan(KCPPlan):
            deterministic = True

        class Context(KCPContext):
            deterministic = True

        ref = weakref.ref(dist.group.WORLD)
        plan = partition([0, 40, 100], world_size, boundary="chunk", plan_cls=Plan)
        context = build_context(plan, rank, plan_cls=Plan, context_cls=Context)
        KEPT.append(context)
        path = os.path.join(payload["dir"], f"rank{rank}")

        def report():  # at exit: the group destroyed, the context still here
            try:
                context.group
                read = "readable"
            except RuntimeError as err:
                read = str(err)
            with open(path, "w") as f:
                f.write(("alive" if ref() is not None else "released") + "|" + read)

        atexit.register(report)
        return context.group is dist.group.WORLD

    def peer_raises(rank, world_size, payload):
        _watch(payload, rank)
        double(torch.ones(2))
        group = dist.group.WORLD  # held by the frame of the error
        if rank == 1:
            raise ValueError("rank one fails on purpose")
        out = torch.empty(world_size, 4)
        dist.all_gather(list(out.unbind(0)), torch.ones(4), group=group)
        return out
    """
)


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(_WORKER)
    return path


def _reports(tmp_path, world_size):
    return [(tmp_path / f"rank{r}").read_text() for r in range(world_size)]


def test_the_group_is_released_after_a_custom_op_call(worker, tmp_path):
    assert run_gloo_world(2, worker, "uses_custom_op", {"dir": str(tmp_path)}) == [[2.0, 2.0]] * 2
    assert _reports(tmp_path, 2) == ["released"] * 2


def test_ranks_exit_1_and_release_the_group_after_a_peer_raised(worker, tmp_path):
    with pytest.raises(RuntimeError, match="rank one fails on purpose") as err:
        run_gloo_world(2, worker, "peer_raises", {"dir": str(tmp_path)}, timeout=120)
    assert re.findall(r"\(exit (-?\d+)\)", str(err.value)) == ["1", "1"], str(err.value)
    assert _reports(tmp_path, 2) == ["released"] * 2


def test_a_kept_context_does_not_hold_its_group(worker, tmp_path):
    """A KCP context holds its group weakly: kept to the end of a script, it neither keeps
    the group alive past ``destroy_process_group()`` nor reads as a live group after."""
    assert run_gloo_world(2, worker, "keeps_a_context", {"dir": str(tmp_path)}) == [True] * 2
    for report in _reports(tmp_path, 2):
        state, read = report.split("|")
        assert state == "released"
        assert "process group this KCP context was built on has been destroyed" in read
