"""``GatedDeltaNetKCP``: the GDN layer on one rank's shard, fast kernels."""

from __future__ import annotations

import torch
from gdn_core.layers import ContextParallelGatedDeltaNet

from gdn_train_kcp.conv import causal_conv1d_kcp
from gdn_train_kcp.gdn import chunk_gated_delta_rule_kcp
from gdn_train_kcp.plan import KCPContext

__all__ = ["GatedDeltaNetKCP"]


class GatedDeltaNetKCP(ContextParallelGatedDeltaNet):
    """Gated DeltaNet layer over ranks on the fastest kernels (within tolerance of
    the single-rank layer).

    ``forward(x [1, T, hidden], context, *, exchange="allgather", backend=None)
    → out [1, T, hidden]`` with ``context`` from :func:`build_context_kcp`.
    Parameters and options as :class:`gdn_core.layers.SingleRankGatedDeltaNet`;
    every rank calls it.
    """

    deterministic = False

    def _conv1d(self, x, weight, bias, context: KCPContext) -> torch.Tensor:
        return causal_conv1d_kcp(x, weight, bias, context, activation="silu")

    def _gdn(self, q, k, v, g, beta, context: KCPContext, exchange: str,
             backend: str | None) -> torch.Tensor:
        return chunk_gated_delta_rule_kcp(q, k, v, g, beta, context=context,
                                          use_qk_l2norm_in_kernel=True,
                                          exchange=exchange, backend=backend)
