"""Causal conv1d across ranks: the halo exchange in front of the GDN kernel.

The conv of width ``W`` reads, for the first tokens of a shard, the previous
``h = W - 1`` tokens of the same document, which live on earlier ranks
(possibly several, when a rank holds fewer than ``h`` of them).

Forward: every rank all-gathers its *tail* (last ``h`` tokens, zero-padded in
front) → ``[world, h, D]``; the halo is picked from it with the context's
host-built table (:class:`~gdn_core.kcp.context.ConvHalo`; zeros before the
document start) and the local conv (:func:`gdn_core.conv1d.causal_conv1d_fwd`)
runs with it — without a halo when the first fragment does not continue, so
a world of one is exactly the single-rank call.

Backward: the local conv backward returns ``dhalo``; every rank lays it out as
contributions to the gathered tail rows (``[world·h, D]``, a gather by the
inverse table — no scatter, no atomics), all-gathers those, and adds the rows
addressed to its own tail from every sender in rank order to ``dx``.
``dweight``/``dbias`` are this rank's partial sums (reduce them across ranks
as for any replicated parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_core.kcp.context import KCPContext
from gdn_core.kcp.exchange import AllGather, drive, drive_simulated
from gdn_core.typed import require_instance

__all__ = ["ConvSaved", "kcp_conv_forward", "kcp_conv_backward", "kcp_conv_forward_simulated",
           "kcp_conv_backward_simulated"]


@dataclass(eq=False)
class ConvSaved:
    """What the KCP conv backward needs (kept by the packages' autograd functions)."""

    context: KCPContext
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    halo: torch.Tensor | None
    activation: str | None
    deterministic: bool


@dataclass
class _ConvArgs:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str | None
    ctx: KCPContext
    deterministic: bool


def _prepare(x, weight, bias, ctx, activation, deterministic, context_cls) -> _ConvArgs:
    from gdn_core.conv1d import validate_conv1d_inputs

    ctx = require_instance(ctx, context_cls, "context")
    validate_conv1d_inputs(x, weight, bias, activation, list(ctx.local_offsets))
    if x.shape[1] != ctx.num_tokens:
        raise ValueError(f"x holds {x.shape[1]} tokens, but rank {ctx.rank}'s shard of the "
                         f"plan holds {ctx.num_tokens}")
    return _ConvArgs(x, weight, bias, activation, ctx, deterministic)


def _tail(x: torch.Tensor, h: int) -> torch.Tensor:
    """The last ``h`` tokens of ``x [1,T,D]`` as ``[h, D]`` fp32/fp64, zero-padded in front."""
    T, D = x.shape[1], x.shape[2]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(h, D, dtype=dt, device=x.device)
    n = min(h, T)
    if n:
        out[h - n:].copy_(x[0, T - n:])
    return out


def _forward_steps(a: _ConvArgs):
    from gdn_core.conv1d import causal_conv1d_fwd

    ctx, tab = a.ctx, a.ctx.table
    Wk = a.weight.shape[1]
    h = Wk - 1
    halo_tab = ctx.conv_halo(Wk)
    D = a.x.shape[2]
    gathered = yield AllGather(_tail(a.x, h))
    halo = None
    if tab.first_continues and h > 0:
        flat = torch.cat([gathered.reshape(-1, D), gathered.new_zeros(1, D)])
        halo = flat.index_select(0, halo_tab.src_t).to(a.x.dtype)[None]
    if tab.empty:
        y = a.x.new_empty(a.x.shape)
    else:
        y = causal_conv1d_fwd(a.x, a.weight, a.bias, a.activation, list(tab.local_offsets),
                              halo, deterministic=a.deterministic)
    return y, ConvSaved(ctx, a.x, a.weight, a.bias, halo, a.activation, a.deterministic)


def _backward_steps(saved: ConvSaved, dy: torch.Tensor):
    from gdn_core.conv1d import causal_conv1d_bwd

    ctx, tab = saved.context, saved.context.table
    x = saved.x
    Wk = saved.weight.shape[1]
    h = Wk - 1
    W = ctx.world_size
    D = x.shape[2]
    halo_tab = ctx.conv_halo(Wk)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    if tab.empty:
        dx = torch.zeros_like(x)
        dw = torch.zeros_like(saved.weight)
        db = torch.zeros_like(saved.bias) if saved.bias is not None else None
        dhalo = None
    else:
        dx, dw, db, dhalo = causal_conv1d_bwd(
            x, saved.weight, saved.bias, dy, saved.activation, list(tab.local_offsets),
            saved.halo, deterministic=saved.deterministic,
        )
    if dhalo is not None:
        ext = torch.cat([dhalo[0].to(dt), dhalo.new_zeros(1, D, dtype=dt)])
        contrib = ext.index_select(0, halo_tab.inv_t)
    else:
        contrib = torch.zeros(W * h, D, dtype=dt, device=x.device)
    got = yield AllGather(contrib)  # [sender, W*h, D]
    n = min(h, x.shape[1])
    if n:
        mine = got[:, ctx.rank * h: (ctx.rank + 1) * h]  # [sender, h, D]
        acc = torch.zeros(h, D, dtype=dt, device=x.device)
        for s in range(W):  # fixed order
            acc = acc + mine[s]
        dx = dx.clone()
        dx[0, x.shape[1] - n:] += acc[h - n:].to(dx.dtype)
    return dx, dw, db


def kcp_conv_forward(x, weight, bias, context, *, activation, deterministic, context_cls):
    """One rank's causal conv1d with halo exchange → ``(y, ConvSaved)``."""
    a = _prepare(x, weight, bias, context, activation, deterministic, context_cls)
    return drive(_forward_steps(a), a.ctx.executor())


def kcp_conv_backward(saved: ConvSaved, dy):
    """One rank's conv backward → ``(dx, dweight, dbias)`` (``dweight``/``dbias`` partial)."""
    _check_dy(saved, dy)
    return drive(_backward_steps(saved, dy), saved.context.executor())


def _check_dy(saved: ConvSaved, dy) -> None:
    if not isinstance(dy, torch.Tensor):
        raise TypeError(f"dy must be a torch.Tensor, got {type(dy).__name__}")
    if dy.shape != saved.x.shape or dy.device != saved.x.device:
        raise ValueError(f"dy must match x ({tuple(saved.x.shape)} on {saved.x.device}), got "
                         f"{tuple(dy.shape)} on {dy.device}")


def kcp_conv_forward_simulated(xs, weight, bias, contexts, *, activation, deterministic,
                               context_cls):
    """Every rank's conv of a simulated world (one shared ``weight``/``bias``)."""
    from gdn_core.kcp.compose import _check_world

    contexts = _check_world(contexts, context_cls)
    if not isinstance(xs, (list, tuple)) or len(xs) != len(contexts):
        raise ValueError(f"xs must be a list of {len(contexts)} tensors (one per rank)")
    args = [_prepare(x, weight, bias, c, activation, deterministic, context_cls)
            for x, c in zip(xs, contexts)]
    out = drive_simulated([_forward_steps(a) for a in args])
    return [y for y, _ in out], [s for _, s in out]


def kcp_conv_backward_simulated(saveds, dys):
    """Every rank's conv backward of a simulated world → ``[(dx, dweight, dbias)]``."""
    if len(saveds) != len(dys):
        raise ValueError("one dy per rank is needed")
    for s, dy in zip(saveds, dys):
        _check_dy(s, dy)
    return drive_simulated([_backward_steps(s, dy) for s, dy in zip(saveds, dys)])
