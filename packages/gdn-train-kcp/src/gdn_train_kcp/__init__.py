"""Context-parallel (KCP) Gated DeltaNet training over torch.distributed, non-deterministic.

The packed sequence is cut into per-rank shards (:func:`partition_kcp`);
each rank builds its context (:func:`build_context_kcp`) and runs
:func:`chunk_gated_delta_rule_kcp` (or :func:`chunk_gdn_fwd_kcp` /
:func:`chunk_gdn_bwd_kcp`) on its shard; document states cross rank
boundaries as fp32 summaries folded in a fixed order. The local kernels run
in their fastest (non-deterministic) configurations: results match the
single-rank run within tolerance (``gdn_det_train_kcp`` is the bitwise
repeatable twin). ``*_simulated`` functions run
every rank of a world in one process (one GPU, tests, benchmarks).
"""

from gdn_core.kcp.plan import Fragment, RankTable

from gdn_train_kcp.conv import causal_conv1d_kcp, causal_conv1d_kcp_simulated
from gdn_train_kcp.gdn import (
    KCPGrads,
    KCPSavedSet,
    KCPWorkspace,
    chunk_gated_delta_rule_kcp,
    chunk_gated_delta_rule_kcp_simulated,
    chunk_gdn_bwd_kcp,
    chunk_gdn_bwd_kcp_simulated,
    chunk_gdn_fwd_kcp,
    chunk_gdn_fwd_kcp_simulated,
)
from gdn_train_kcp.layers import GatedDeltaNetKCP
from gdn_train_kcp.plan import (
    KCPContext,
    KCPPlan,
    build_context_kcp,
    build_simulated_contexts_kcp,
    partition_kcp,
    update_context_kcp,
)

__version__ = "0.1.0"

__all__ = [
    "GatedDeltaNetKCP",
    "KCPContext",
    "KCPGrads",
    "KCPPlan",
    "KCPSavedSet",
    "KCPWorkspace",
    "Fragment",
    "RankTable",
    "build_context_kcp",
    "build_simulated_contexts_kcp",
    "causal_conv1d_kcp",
    "causal_conv1d_kcp_simulated",
    "chunk_gated_delta_rule_kcp",
    "chunk_gated_delta_rule_kcp_simulated",
    "chunk_gdn_bwd_kcp",
    "chunk_gdn_bwd_kcp_simulated",
    "chunk_gdn_fwd_kcp",
    "chunk_gdn_fwd_kcp_simulated",
    "partition_kcp",
    "update_context_kcp",
]

# Zero-argument entry points the import-independence checker runs.
__smoke__ = ["gdn_train_kcp.smoke:run"]
