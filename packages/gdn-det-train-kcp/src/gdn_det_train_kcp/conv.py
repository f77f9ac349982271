"""Deterministic causal conv1d across ranks (the halo exchange).

See :mod:`gdn_core.kcp.conv`: the previous ranks' last ``kernel_size − 1``
tokens of the document continuing here are all-gathered, and in backward
their gradient is sent back and added in rank order. ``dweight``/``dbias``
are this rank's partial sums (sum them over ranks, as data parallelism does
for any replicated parameter).
"""

from __future__ import annotations

from gdn_det_train_kcp.ops import API

__all__ = ["causal_conv1d_det_kcp", "causal_conv1d_det_kcp_simulated"]

causal_conv1d_det_kcp = API.conv
causal_conv1d_det_kcp_simulated = API.conv_simulated
