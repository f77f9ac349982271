"""Causal conv1d across ranks (the halo exchange), non-deterministic mode.

See :mod:`gdn_core.kcp.conv`: the previous ranks' last ``kernel_size − 1``
tokens of the document continuing here are all-gathered, and in backward
their gradient is sent back and added in rank order. ``dweight``/``dbias``
are this rank's partial sums (sum them over ranks, as data parallelism does
for any replicated parameter).
"""

from __future__ import annotations

import torch
from gdn_core.kcp.conv import (
    kcp_conv_backward,
    kcp_conv_backward_simulated,
    kcp_conv_forward,
    kcp_conv_forward_simulated,
)
from torch.autograd.function import once_differentiable

from gdn_train_kcp.plan import KCPContext

__all__ = ["causal_conv1d_kcp", "causal_conv1d_kcp_simulated"]


class _KCPConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, weight, bias, context, activation):
        y, saved = kcp_conv_forward(x, weight, bias, context, activation=activation,
                                    deterministic=False, context_cls=KCPContext)
        fctx.kcp_saved = saved
        return y

    @staticmethod
    @once_differentiable
    def backward(fctx, dy):
        saved, fctx.kcp_saved = fctx.kcp_saved, None
        dx, dw, db = kcp_conv_backward(saved, dy.contiguous())
        return dx, dw, db, None, None


def causal_conv1d_kcp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    context: KCPContext,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv1d of this rank's shard ``x [1,T,D]`` → ``y [1,T,D]``.

    ``weight: [D, W]``, ``bias: [D]`` or ``None``, ``activation`` ``"silu"`` or
    ``None``. Tokens read the previous ``W-1`` tokens of their own document,
    across ranks (halo exchange; also in backward). Differentiable in ``x``,
    ``weight`` and ``bias``. Every rank must call it (and its backward).
    """
    return _KCPConvFunction.apply(x, weight, bias, context, activation)


class _KCPConvSimFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, contexts, activation, weight, bias, *xs):
        ys, saveds = kcp_conv_forward_simulated(list(xs), weight, bias, list(contexts),
                                                activation=activation, deterministic=False,
                                                context_cls=KCPContext)
        fctx.kcp_saved = saveds
        fctx.has_bias = bias is not None
        return tuple(ys)

    @staticmethod
    @once_differentiable
    def backward(fctx, *dys):
        saveds, fctx.kcp_saved = fctx.kcp_saved, None
        out = kcp_conv_backward_simulated(saveds, [d.contiguous() for d in dys])
        dw = out[0][1]
        for _, w, _ in out[1:]:  # rank order
            dw = dw + w
        db = None
        if fctx.has_bias:
            db = out[0][2]
            for _, _, b in out[1:]:
                db = db + b
        return (None, None, dw, db, *(dx for dx, _, _ in out))


def causal_conv1d_kcp_simulated(xs, weight, bias, contexts, activation="silu"):
    """Every rank's conv of a simulated world → ``[y]``; ``dweight``/``dbias``
    are summed over ranks in rank order."""
    return list(_KCPConvSimFunction.apply(tuple(contexts), activation, weight, bias, *xs))
