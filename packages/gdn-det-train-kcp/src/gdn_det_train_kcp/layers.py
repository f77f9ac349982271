"""``GatedDeltaNetKCP``: the GDN layer on one rank's shard, deterministic."""

from __future__ import annotations

import torch
from gdn_core.layers import ContextParallelGatedDeltaNet

from gdn_det_train_kcp.conv import causal_conv1d_det_kcp
from gdn_det_train_kcp.gdn import chunk_gated_delta_rule_det_kcp
from gdn_det_train_kcp.plan import DetKCPContext

__all__ = ["GatedDeltaNetKCP"]


class GatedDeltaNetKCP(ContextParallelGatedDeltaNet):
    """Gated DeltaNet layer over ranks, bitwise repeatable for a fixed plan.

    ``forward(x [1, T, hidden], context, *, exchange="allgather", backend=None)
    → out [1, T, hidden]`` with ``context`` from :func:`build_context_det_kcp`
    (the conv halo and the document states cross ranks). Parameters and options
    as :class:`gdn_core.layers.SingleRankGatedDeltaNet`; every rank calls it.
    """

    deterministic = True

    def _conv1d(self, x, weight, bias, context: DetKCPContext) -> torch.Tensor:
        return causal_conv1d_det_kcp(x, weight, bias, context, activation="silu")

    def _gdn(self, q, k, v, g, beta, context: DetKCPContext, exchange: str,
             backend: str | None) -> torch.Tensor:
        return chunk_gated_delta_rule_det_kcp(q, k, v, g, beta, context=context,
                                              use_qk_l2norm_in_kernel=True,
                                              exchange=exchange, backend=backend)
