"""Causal conv1d across ranks (the halo exchange), non-deterministic mode.

See :mod:`gdn_core.kcp.conv`: the previous ranks' last ``kernel_size − 1``
tokens of the document continuing here are all-gathered, and in backward
their gradient is sent back and added in rank order. ``dweight``/``dbias``
are this rank's partial sums (sum them over ranks, as data parallelism does
for any replicated parameter).
"""

from __future__ import annotations

import torch

from gdn_train_kcp.gdn import _OPS
from gdn_train_kcp.plan import KCPContext

__all__ = ["causal_conv1d_kcp", "causal_conv1d_kcp_simulated"]


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
    return _OPS.causal_conv1d(x, weight, bias, context, activation)


def causal_conv1d_kcp_simulated(xs, weight, bias, contexts, activation="silu"):
    """Every rank's conv of a simulated world → ``[y]``; ``dweight``/``dbias``
    are summed over ranks in rank order."""
    return _OPS.causal_conv1d_simulated(xs, weight, bias, contexts, activation)
