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


def _call(api, sfx: str, ctx, exchange: str, *, HV: int = 2, dtype=torch.float32,
          beta_scale: float = 1.0, check_inputs: bool = False, autograd: bool = False) -> None:
    n = ctx.num_tokens
    q = torch.randn(1, n, 1, 16, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(1, n, 1, 16, dtype=dtype), dim=-1)
    v, g = torch.randn(1, n, HV, 16, dtype=dtype), -torch.rand(1, n, HV, dtype=dtype)
    b = torch.rand(1, n, HV, dtype=dtype) * beta_scale
    det = "_det" if sfx == "_det_kcp" else ""
    if autograd:
        getattr(api, f"chunk_gated_delta_rule{det}_kcp")(
            q, k, v, g, b, context=ctx, exchange=exchange, check_inputs=check_inputs)
    else:
        getattr(api, f"chunk_gdn{det}_fwd_kcp")(q, k, v, g, b, ctx, exchange=exchange,
                                                check_inputs=check_inputs)


def _modified_backward(api, sfx: str, ctx, rank: int, *, modify: bool) -> None:
    """A split forward, then — on rank 1 with ``modify`` — ``v`` modified in place, then
    the backward with ``check_inputs=True`` (the ranks agree on the in-place check)."""
    det = "_det" if sfx == "_det_kcp" else ""
    n = ctx.num_tokens
    gen = torch.Generator().manual_seed(11 + rank)
    q = torch.randn(1, n, 1, 16, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, n, 1, 16, generator=gen), dim=-1)
    v, g = torch.randn(1, n, 2, 16, generator=gen), -torch.rand(1, n, 2, generator=gen)
    b = torch.rand(1, n, 2, generator=gen)
    o, saved = getattr(api, f"chunk_gdn{det}_fwd_kcp")(q, k, v, g, b, ctx)
    if modify and rank == 1:
        v.mul_(2.0)
    getattr(api, f"chunk_gdn{det}_bwd_kcp")(saved, torch.ones_like(o), check_inputs=True)


def _undeclared_calls(rank: int) -> dict[str, dict[str, Any]]:
    """Per scenario: this rank's call on a context built without a declaration (rank 1
    differs from rank 0): the first call of a signature is agreed on by every rank."""
    one = rank == 1
    return {
        "call_heads": {"HV": 4 if one else 2},
        "call_dtype": {"dtype": torch.float64 if one else torch.float32},
        "call_exchange": {"exchange": "ring" if one else "allgather"},
        "call_agreed": {},
        "call_agreed_again": {},
        "call_check_inputs": {"beta_scale": 2.0 if one else 1.0, "check_inputs": True},
        "call_check_inputs_autograd": {"beta_scale": 2.0 if one else 1.0,
                                       "check_inputs": True, "autograd": True},
        "call_check_inputs_clean": {"check_inputs": True, "autograd": True},
    }


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
    free = _build(api, sfx, rank, {})  # nothing declared
    for name, kw in _undeclared_calls(rank).items():
        kw = dict(kw)
        out[name] = _outcome(lambda kw=kw: _call(api, sfx, free, kw.pop("exchange", "allgather"),
                                                 **kw))
    out["agreed_calls"] = len(free.agreed_calls)
    for name, modify in (("bwd_unmodified", False), ("bwd_modified", True)):
        out[name] = _outcome(lambda m=modify: _modified_backward(api, sfx, free, rank, modify=m))
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


def check_backward_in_place(outcomes: list[dict]) -> None:
    """The split backward with ``check_inputs=True``: unmodified inputs run on both ranks;
    ``v`` modified in place on rank 1 stops both — rank 1 with its own ``ValueError``,
    rank 0 with one naming rank 1 — within seconds, before the backward's exchange."""
    for o in outcomes:
        assert o["bwd_unmodified"]["error"] is None, o["bwd_unmodified"]
    check_one_rank_failed(outcomes, "bwd_modified", "v was modified in place")


def check_split_backward_in_place(api: Any) -> None:
    """A world of one and a simulated world of two: the split backward refuses a saved
    set whose forward input was modified in place since (``ValueError`` naming it),
    with or without ``check_inputs``; an unmodified one runs."""
    import pytest

    sfx = _suffix(api)
    plan = _fn(api, sfx, "partition{sfx}")([0, 40, 70], 1)
    ctx = _fn(api, sfx, "build_context{sfx}")(plan, 0)
    fwd, bwd = _fn(api, sfx, "chunk_gdn{det}_fwd_kcp"), _fn(api, sfx, "chunk_gdn{det}_bwd_kcp")
    q = torch.randn(1, 70, 1, 16)
    k = torch.nn.functional.normalize(torch.randn(1, 70, 1, 16), dim=-1)
    v, g, b = torch.randn(1, 70, 2, 16), -torch.rand(1, 70, 2), torch.rand(1, 70, 2)
    o, saved = fwd(q, k, v, g, b, ctx)
    bwd(saved, torch.ones_like(o))
    for check_inputs in (False, True):
        o, saved = fwd(q, k, v, g, b, ctx)
        g.sub_(0.1)
        with pytest.raises(ValueError, match="g was modified in place after chunk_gdn"):
            bwd(saved, torch.ones_like(o), check_inputs=check_inputs)
    with pytest.raises(TypeError, match="check_inputs must be a bool"):
        bwd(saved, torch.ones_like(o), check_inputs="yes")
    ctxs, ins = _sim_world(api, sfx, (torch.float32,) * 2, (2, 2))
    os_, saveds = _fn(api, sfx, "chunk_gdn{det}_fwd_kcp_simulated")(*ins, ctxs)
    ins[2][1].mul_(2.0)  # rank 1's v
    with pytest.raises(ValueError, match="v was modified in place after chunk_gdn"):
        _fn(api, sfx, "chunk_gdn{det}_bwd_kcp_simulated")(
            saveds, [torch.ones_like(o) for o in os_])


def check_calls(outcomes: list[dict]) -> None:
    """The agreeing build worked; its declared call ran and another exchange raised."""
    for o in outcomes:
        assert o["agree"]["error"] is None, o["agree"]
        assert o["call_declared"]["error"] is None, o["call_declared"]
        err = o["call_undeclared"]["error"]
        assert err is not None and err[0] == "ValueError" and "exchange" in err[1], err


CALL_DISAGREEMENTS = {"call_heads": "HV: rank 0: 2, rank 1: 4",
                      "call_dtype": "dtype: rank 0: float32, rank 1: float64",
                      "call_exchange": "exchange: rank 0: allgather, rank 1: ring"}


def check_undeclared_calls(outcomes: list[dict]) -> None:
    """Without a declaration, the first call of a signature is agreed on: ranks whose
    heads, dtype or exchange differ raise the same ``ValueError`` within seconds (not a
    gloo abort or a deadlock); an agreed signature is remembered (one entry, also after
    its second call and the ``check_inputs`` calls); ``check_inputs`` stops every rank
    when one rank's ``beta`` is out of range."""
    for name, word in CALL_DISAGREEMENTS.items():
        errs = [o[name]["error"] for o in outcomes]
        assert all(e is not None and e[0] == "ValueError" for e in errs), (name, errs)
        assert errs[0][1] == errs[1][1] and word in errs[0][1], (name, errs)
        assert "first call" in errs[0][1], errs
        assert all(o[name]["seconds"] < MAX_SECONDS for o in outcomes), outcomes
    for o in outcomes:
        for name in ("call_agreed", "call_agreed_again", "call_check_inputs_clean"):
            assert o[name]["error"] is None, (name, o[name])
        assert o["agreed_calls"] == 1, o["agreed_calls"]
    for name in ("call_check_inputs", "call_check_inputs_autograd"):
        mine, peer = outcomes[1][name]["error"], outcomes[0][name]["error"]
        assert mine is not None and mine[0] == "ValueError", mine
        assert "beta must lie in [0, 1], got beta[" in mine[1], mine
        assert peer is not None and peer[0] == "ValueError", peer
        assert "check_inputs refused the inputs of ranks [1] of 2" in peer[1], peer


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


def check_inputs_checked(api: Any) -> None:
    """``check_inputs=True`` on a world of one (every call form) and a simulated world:
    ``g > 0`` and ``beta`` outside ``[0, 1]`` raise ``ValueError`` naming the value (the
    simulated world: the rank too); ``g = -inf`` is accepted; unchecked by default."""
    import pytest

    sfx = _suffix(api)
    det = "_det" if sfx == "_det_kcp" else ""
    plan = _fn(api, sfx, "partition{sfx}")([0, 40, 70], 1)
    ctx = _fn(api, sfx, "build_context{sfx}")(plan, 0)
    fwd = _fn(api, sfx, "chunk_gdn{det}_fwd_kcp")
    auto = getattr(api, f"chunk_gated_delta_rule{det}_kcp")
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 70, 1, 16, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, 70, 1, 16, generator=gen), dim=-1)
    v, g = torch.randn(1, 70, 2, 16, generator=gen), -torch.rand(1, 70, 2, generator=gen)
    beta = torch.rand(1, 70, 2, generator=gen)
    g_reset = g.clone()
    g_reset[0, 50, 1] = float("-inf")
    o, _ = fwd(q, k, v, g_reset, beta, ctx, check_inputs=True)
    assert torch.isfinite(o).all()
    g_bad = g.clone()
    g_bad[0, 12, 0] = 0.25
    fwd(q, k, v, g_bad, beta, ctx)  # not read by default
    for call in (lambda: fwd(q, k, v, g_bad, beta, ctx, check_inputs=True),
                 lambda: auto(q, k, v, g_bad, beta, context=ctx, check_inputs=True)):
        with pytest.raises(ValueError, match=r"g must be <= 0 .* got g\[0, 12, 0\] = 0.25"):
            call()
    with pytest.raises(TypeError, match="check_inputs must be a bool"):
        fwd(q, k, v, g, beta, ctx, check_inputs=1)
    ctxs, ins = _sim_world(api, sfx, (torch.float32,) * 2, (2, 2))
    ins[4][1] = ins[4][1] + 1.0  # rank 1's beta in [1, 2)
    for call in ("chunk_gdn{det}_fwd_kcp_simulated", "chunk_gated_delta_rule{det}_kcp_simulated"):
        fn = _fn(api, sfx, call)
        kw = {"contexts": ctxs} if "rule" in call else {}
        args = ins if "rule" in call else (*ins, ctxs)
        with pytest.raises(ValueError, match=r"rank 1: beta must lie in \[0, 1\]"):
            fn(*args, check_inputs=True, **kw)
