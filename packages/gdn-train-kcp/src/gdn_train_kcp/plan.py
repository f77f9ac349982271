"""Partition plans and rank contexts of the (non-deterministic) KCP package.

Thin, mode-typed wrappers over :mod:`gdn_core.kcp.plan` and
:mod:`gdn_core.kcp.context` (the shared logic lives there).
"""

from __future__ import annotations

from gdn_core.kcp.plan import Fragment, RankTable

from gdn_train_kcp._typed import KCPContext, KCPPlan
from gdn_train_kcp.ops import API

__all__ = [
    "KCPContext",
    "KCPPlan",
    "Fragment",
    "RankTable",
    "build_context_kcp",
    "build_simulated_contexts_kcp",
    "partition_kcp",
    "update_context_kcp",
]

partition_kcp = API.partition
build_context_kcp = API.build_context
update_context_kcp = API.update_context
build_simulated_contexts_kcp = API.build_simulated_contexts
