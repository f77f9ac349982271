"""Deterministic causal depthwise conv1d."""

from __future__ import annotations

import torch
from gdn_core.layout import VarlenLayout

from gdn_det_train.ops import OPS

__all__ = ["causal_conv1d_det"]


def causal_conv1d_det(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | list[int] | VarlenLayout | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d, differentiable, with bitwise-deterministic gradients.

    ``x: [B,T,D]``, ``weight: [D,W]`` (``weight[:, -1]`` multiplies the current
    token), ``bias: [D]`` or ``None``, ``activation`` ``"silu"``/``"swish"`` or
    ``None``, ``cu_seqlens: [N+1]`` (``B == 1``): no token sees a previous
    document (or a :class:`VarlenLayout`: fixed-size device tables, see
    :mod:`gdn_core.layout`). Returns ``y: [B,T,D]`` in ``x``'s dtype. The weight and bias
    gradients (sums over all tokens) are reduced in a fixed order.
    """
    return OPS.causal_conv1d(x, weight, bias, activation, cu_seqlens)
