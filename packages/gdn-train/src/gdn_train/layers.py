"""``GatedDeltaNet``: the GDN layer on this package's fast (non-deterministic) kernels."""

from __future__ import annotations

from typing import Any

import torch
from gdn_core.layers import SingleRankGatedDeltaNet

from gdn_train.api import chunk_gated_delta_rule
from gdn_train.conv import causal_conv1d

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(SingleRankGatedDeltaNet):
    """Gated DeltaNet layer on the fastest kernels (results within tolerance of the
    reference, not bitwise repeatable).

    Parameters, options and ``forward(x, cu_seqlens=None, initial_state=None,
    output_final_state=False) → (out, final_state)`` as
    :class:`gdn_core.layers.SingleRankGatedDeltaNet` (fla's parameter names;
    ``GatedDeltaNet.from_qwen3_next(layer)`` takes a transformers layer's
    weights). Runs :func:`causal_conv1d` and :func:`chunk_gated_delta_rule`.
    """

    deterministic = False

    def _conv1d(self, x, weight, bias, cu_seqlens) -> torch.Tensor:
        return causal_conv1d(x, weight, bias, "silu", cu_seqlens)

    def _gdn(self, q, k, v, g, beta, **kwargs: Any):
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kwargs)
