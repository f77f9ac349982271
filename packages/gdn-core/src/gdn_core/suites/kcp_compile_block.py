"""A small GDN block (short conv → KCP GDN → projection) for the KCP compile tests.

Every rank's block: ``x [1,T_r,D]`` → causal conv with the halo exchange → q, k, v →
the KCP GDN → a projection, written once over a package's
:class:`~gdn_core.kcp_frontend.KCPAPI` (:func:`blocks`). Also the gloo worker of the
two-rank compile test (:func:`compile_worker`, loaded by path by
:func:`gdn_core.kcp.testing.run_gloo_world`; its payload names the package).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from gdn_core.suites.block_params import block_params
from gdn_core.suites.kcp_run import shard

H, HV, K, V, W = 1, 2, 16, 16, 4
D = 2 * H * K + HV * V


def make_params(T: int, seed: int = 0, device="cpu", dtype=torch.float32) -> dict:
    p = block_params(T, D, HV, V, W, seed=seed, proj_rows=8, proj_scale=0.2)
    return {n: t.to(device=device, dtype=dtype) for n, t in p.items()}


def blocks(api: Any) -> tuple[Callable, Callable]:
    """``(rank_block, world_block)`` on ``api``'s conv and GDN calls (one rank; every
    rank of a simulated world)."""

    def rank_block(x, g, beta, w, b, P, context, exchange="allgather"):
        T = x.shape[1]
        y = api.conv(x, w, b, context, "silu")
        q, k, v = y.split([H * K, H * K, HV * V], dim=-1)
        o = api.autograd(
            q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, V), g, beta,
            context=context, use_qk_l2norm_in_kernel=True, exchange=exchange)
        return o.reshape(1, T, HV * V) @ P.T

    def world_block(xs, gs, betas, w, b, P, contexts, exchange="allgather"):
        ys = api.conv_simulated(xs, w, b, contexts, "silu")
        qs, ks, vs = [], [], []
        for y in ys:
            T = y.shape[1]
            q, k, v = y.split([H * K, H * K, HV * V], dim=-1)
            qs.append(q.reshape(1, T, H, K))
            ks.append(k.reshape(1, T, H, K))
            vs.append(v.reshape(1, T, HV, V))
        os_ = api.autograd_simulated(qs, ks, vs, gs, betas, contexts=contexts,
                                     use_qk_l2norm_in_kernel=True, exchange=exchange)
        return [o.reshape(1, o.shape[1], HV * V) @ P.T for o in os_]

    return rank_block, world_block


def on(api: Any) -> types.SimpleNamespace:
    """This module with its blocks bound to ``api`` (``rank_block``, ``world_block``)."""
    ns = types.SimpleNamespace(**{n: globals()[n] for n in (
        "H", "HV", "K", "V", "W", "D", "make_params", "shard", "rank_step", "world_step")})
    ns.rank_block, ns.world_block = blocks(api)
    return ns


def rank_step(fn, params: dict, plan, rank: int, context, exchange="allgather") -> list:
    """One rank's forward + backward; returns the output and every gradient."""
    leaves = {n: (shard(t, plan, rank) if n in ("x", "g", "beta") else t.clone())
              .requires_grad_() for n, t in params.items()}
    out = fn(*leaves.values(), context, exchange)
    (out * out).sum().backward()
    return [out.detach()] + [t.grad for t in leaves.values()]


def world_step(fn, params: dict, plan, contexts, exchange="allgather") -> list:
    """Every rank of a simulated world: outputs and gradients (sharded ones per rank)."""
    R = plan.world_size
    sh = {n: [shard(params[n], plan, r).requires_grad_() for r in range(R)]
          for n in ("x", "g", "beta")}
    rep = {n: params[n].clone().requires_grad_() for n in ("w", "b", "P")}
    outs = fn(sh["x"], sh["g"], sh["beta"], rep["w"], rep["b"], rep["P"], contexts, exchange)
    sum((o * o).sum() for o in outs).backward()
    return ([o.detach() for o in outs] + [t.grad for n in ("x", "g", "beta") for t in sh[n]]
            + [rep[n].grad for n in ("w", "b", "P")])


def compile_worker(api: Any, rank: int, world_size: int, payload: dict) -> dict:
    """One gloo rank: the compiled rank block on ``api`` against the eager one, for each
    layout (``payload``: ``layouts``, ``seed``, ``exchange``)."""
    from torch._dynamo.utils import counters

    rank_block, _ = blocks(api)
    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()
    compiled = torch.compile(rank_block, fullgraph=True, backend="aot_eager")
    equal = []
    for offs in payload["layouts"]:
        plan = api.partition(offs, world_size, boundary="even")
        ctx = api.build_context(plan, rank, conv_kernel_size=W)
        params = make_params(offs[-1], seed=payload["seed"])
        got = rank_step(compiled, params, plan, rank, ctx, payload["exchange"])
        want = rank_step(rank_block, params, plan, rank, ctx, payload["exchange"])
        equal.append(all(torch.equal(a, c) for a, c in zip(got, want)))
    return {"equal": equal, "breaks": len(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"]}
