"""Deterministic causal depthwise conv1d."""

from __future__ import annotations

from gdn_det_train.ops import API

__all__ = ["causal_conv1d_det"]

causal_conv1d_det = API.conv_call(
    "causal_conv1d_det",
    summary="Causal depthwise conv1d, differentiable, with bitwise-deterministic gradients.",
    reduction="are reduced in a fixed order")
