"""Partition plans and rank contexts of the deterministic KCP package.

Thin, mode-typed wrappers over :mod:`gdn_core.kcp.plan` and
:mod:`gdn_core.kcp.context` (the shared logic lives there).
"""

from __future__ import annotations

from gdn_core.kcp.plan import Fragment, RankTable

from gdn_det_train_kcp._typed import DetKCPContext, DetKCPPlan
from gdn_det_train_kcp.ops import API

__all__ = [
    "DetKCPContext",
    "DetKCPPlan",
    "Fragment",
    "RankTable",
    "build_context_det_kcp",
    "build_simulated_contexts_det_kcp",
    "partition_det_kcp",
    "update_context_det_kcp",
]

partition_det_kcp = API.partition
build_context_det_kcp = API.build_context
update_context_det_kcp = API.update_context
build_simulated_contexts_det_kcp = API.build_simulated_contexts
