"""Causal depthwise conv1d (fast mode)."""

from __future__ import annotations

from gdn_train.ops import API

__all__ = ["causal_conv1d"]

causal_conv1d = API.conv_call(
    "causal_conv1d", summary="Causal depthwise conv1d, differentiable.",
    reduction="use the fastest reduction available")
