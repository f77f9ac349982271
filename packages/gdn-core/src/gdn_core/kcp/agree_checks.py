"""The cross-rank agreement checks shared by both KCP packages' tests.

:func:`run_scenarios` (called by each package's gloo worker file with the
package module) runs, on every rank of a world of two, context
builds whose arguments differ between the ranks in one respect each (world
size, rank, boundary, declared heads, head dimensions, dtype, exchange, conv
width, a bad argument or an unusable device on one rank), and records what
each raised and how long it took. The ``check_*`` functions are
the parent's assertions on those outcomes, and the in-process checks of
simulated worlds and device arguments, shared by both packages' tests.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["SCENARIOS", "run_scenarios"]

OFFSETS = [0, 100, 101, 250]


def _variants(rank: int) -> dict[str, dict[str, Any]]:
    """Per scenario: this rank's ``world`` (of its plan), ``rank``, ``boundary`` and
    build keywords (rank 1 differs from rank 0)."""
    one = rank == 1
    return {
        "agree": {"kw": {"heads": (1, 2), "head_dims": (16, 16), "dtype": torch.float32,
                         "exchange": "ring", "conv_kernel_size": 4}},
        "world_size": {"world": 3 if one else 2},
        "world_of_group": {"world": 3},
        "rank": {"rank": 0},
        "boundary": {"boundary": "even" if one else "chunk"},
        "exchange": {"kw": {"exchange": "ring" if one else "allgather"}},
        "heads": {"kw": {"heads": (1, 4) if one else (1, 2)}},
        "head_dims": {"kw": {"head_dims": (16, 32) if one else (16, 16)}},
        "dtype": {"kw": {"dtype": torch.float64 if one else torch.float32}},
        "conv_kernel_size": {"kw": {"conv_kernel_size": 3 if one else 4}},
        "local_error": {"kw": {"conv_kernel_size": 0 if one else 4}},
        "device": {"kw": {"device": "cuda" if one else "cpu"}},
    }


SCENARIOS = tuple(_variants(0))


def _suffix(api: Any) -> str:
    """The names' suffix of a KCP package module: ``"_det_kcp"`` or ``"_kcp"``."""
    return "_det_kcp" if getattr(api, "__name__", "").startswith("gdn_det") else "_kcp"


def _build(api, sfx: str, rank: int, v: dict) -> Any:
    plan = getattr(api, "partition" + sfx)(OFFSETS, v.get("world", 2),
                                           boundary=v.get("boundary", "chunk"))
    return getattr(api, "build_context" + sfx)(plan, v.get("rank", rank), **v.get("kw", {}))


def _outcome(fn) -> dict:
    t0 = time.perf_counter()
    try:
        fn()
        err = None
    except Exception as e:  # noqa: BLE001 - recorded for the parent to check
        err = (type(e).__name__, str(e))
    return {"error": err, "seconds": time.perf_counter() - t0}


def _call(api, sfx: str, ctx, exchange: str) -> None:
    n = ctx.num_tokens
    q, k = torch.randn(1, n, 1, 16), torch.nn.functional.normalize(torch.randn(1, n, 1, 16), dim=-1)
    v, g, b = torch.randn(1, n, 2, 16), -torch.rand(1, n, 2), torch.rand(1, n, 2)
    getattr(api, "chunk_gdn" + ("_det" if sfx == "_det_kcp" else "") + "_fwd_kcp")(
        q, k, v, g, b, ctx, exchange=exchange)


def run_scenarios(api: Any, rank: int) -> dict:
    """Every scenario's outcome on this rank of a gloo world of two (``api``: the KCP
    package module) → ``{name: {"error": (type, message) | None, "seconds": float}}``,
    then a declared context's calls: the declared exchange runs, another raises (on
    both ranks, before any collective)."""
    import torch.distributed as dist

    sfx = _suffix(api)
    out = {name: _outcome(lambda v=v: _build(api, sfx, rank, v))
           for name, v in _variants(rank).items()}
    ctx = _build(api, sfx, rank, _variants(rank)["agree"])
    out["call_declared"] = _outcome(lambda: _call(api, sfx, ctx, "ring"))
    out["call_undeclared"] = _outcome(lambda: _call(api, sfx, ctx, "allgather"))
    dist.barrier()
    return out


# ------------------------------------------------------- parent-side checks --

DISAGREEMENTS = {  # scenario -> a word its message must hold
    "world_size": "world_size", "world_of_group": "process group has 2", "rank": "rank=",
    "boundary": "boundary", "exchange": "exchange", "heads": "HV", "head_dims": "V:",
    "dtype": "dtype", "conv_kernel_size": "conv_kernel_size",
}
MAX_SECONDS = 60.0  # far below any process-group timeout


def check_disagreement(outcomes: list[dict], name: str) -> None:
    """Both ranks raised the same ``ValueError`` naming what differs, within seconds."""
    errs = [o[name]["error"] for o in outcomes]
    assert all(e is not None and e[0] == "ValueError" for e in errs), errs
    assert errs[0][1] == errs[1][1], errs
    assert DISAGREEMENTS[name] in errs[0][1], errs[0][1]
    assert all(o[name]["seconds"] < MAX_SECONDS for o in outcomes), outcomes


def check_one_rank_failed(outcomes: list[dict], name: str, own: str) -> None:
    """Rank 1 raised its own ``ValueError`` (holding ``own``); rank 0 one naming rank 1."""
    mine, peer = outcomes[1][name]["error"], outcomes[0][name]["error"]
    assert mine is not None and mine[0] == "ValueError" and own in mine[1], mine
    assert peer is not None and peer[0] == "ValueError" and "ranks [1]" in peer[1], peer
    assert all(o[name]["seconds"] < MAX_SECONDS for o in outcomes), outcomes


def check_calls(outcomes: list[dict]) -> None:
    """The agreeing build worked; its declared call ran and another exchange raised."""
    for o in outcomes:
        assert o["agree"]["error"] is None, o["agree"]
        assert o["call_declared"]["error"] is None, o["call_declared"]
        err = o["call_undeclared"]["error"]
        assert err is not None and err[0] == "ValueError" and "exchange" in err[1], err


# ----------------------------------------------------- simulated worlds (in-process) --


def _fn(api, sfx: str, stem: str):
    """``api``'s function ``stem`` of this mode: ``chunk_gdn{_det}_fwd_kcp_simulated`` …"""
    name = stem.replace("{det}", "_det" if sfx == "_det_kcp" else "").replace("{sfx}", sfx)
    return getattr(api, name)


def _sim_world(api, sfx: str, dtypes, HVs, **declared):
    """A simulated world of ``len(dtypes)`` ranks over an even cut of ``[0, 40, 70]`` and
    its per-rank ``(qs, ks, vs, gs, betas)``: rank ``r`` in ``dtypes[r]`` with ``HVs[r]``
    value heads."""
    world = len(dtypes)
    plan = _fn(api, sfx, "partition{sfx}")([0, 40, 70], world, boundary="even")
    ctxs = _fn(api, sfx, "build_simulated_contexts{sfx}")(plan, **declared)
    shards = []
    for r in range(world):
        n, dt, HV = plan.num_tokens(r), dtypes[r], HVs[r]
        q = torch.randn(1, n, 1, 16, dtype=dt)
        k = torch.nn.functional.normalize(torch.randn(1, n, 1, 16, dtype=dt), dim=-1)
        shards.append((q, k, torch.randn(1, n, HV, 16, dtype=dt),
                       -torch.rand(1, n, HV, dtype=dt), torch.rand(1, n, HV, dtype=dt)))
    return ctxs, [list(x) for x in zip(*shards)]


def check_simulated_disagreement(api: Any, dtypes, HVs) -> None:
    """Simulated ranks whose tensors differ (dtype, value heads) raise ``ValueError``."""
    import pytest

    sfx = _suffix(api)
    ctxs, ins = _sim_world(api, sfx, dtypes, HVs)
    with pytest.raises(ValueError, match="tensors of one .* differ"):
        _fn(api, sfx, "chunk_gdn{det}_fwd_kcp_simulated")(*ins, ctxs)


def check_simulated_declaration(api: Any) -> None:
    """Simulated contexts hold their calls to what the build declared."""
    import pytest

    sfx = _suffix(api)
    fwd = _fn(api, sfx, "chunk_gdn{det}_fwd_kcp_simulated")
    f32 = (torch.float32,) * 2
    ctxs, ins = _sim_world(api, sfx, f32, (2, 2), heads=(1, 2), head_dims=(16, 16),
                           dtype=torch.float32, exchange="ring")
    fwd(*ins, ctxs, exchange="ring")
    with pytest.raises(ValueError, match="declaring exchange='ring'"):
        fwd(*ins, ctxs)
    ctxs, ins = _sim_world(api, sfx, f32, (2, 2), dtype=torch.float64)
    with pytest.raises(ValueError, match="declaring dtype=torch.float64"):
        fwd(*ins, ctxs)


def check_cuda_refused(api: Any) -> None:
    """``device="cuda"`` without CUDA: ``ValueError`` from the rank and simulated builds."""
    import pytest

    sfx = _suffix(api)
    partition = _fn(api, sfx, "partition{sfx}")
    for build, plan in ((_fn(api, sfx, "build_context{sfx}"), partition([0, 8], 1)),
                        (_fn(api, sfx, "build_simulated_contexts{sfx}"), partition([0, 8], 2))):
        args = (plan, 0) if plan.world_size == 1 else (plan,)
        with pytest.raises(ValueError, match="device='cuda' was given, but CUDA is not"):
            build(*args, device="cuda")
