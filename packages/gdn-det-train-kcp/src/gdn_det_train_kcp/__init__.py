"""Context-parallel (KCP) Gated DeltaNet training over torch.distributed, bitwise deterministic.

The packed sequence is cut into per-rank shards (:func:`partition_det_kcp`);
each rank builds its context (:func:`build_context_det_kcp`) and runs
:func:`chunk_gated_delta_rule_det_kcp` (or :func:`chunk_gdn_det_fwd_kcp` /
:func:`chunk_gdn_det_bwd_kcp`) on its shard; document states cross rank
boundaries as fp32 summaries folded in a fixed order. Results are bitwise
repeatable for a fixed world size and plan, and at ``world_size == 1`` bitwise
equal to the single-rank deterministic path. ``*_simulated`` functions run
every rank of a world in one process (one GPU, tests, benchmarks).
"""

from gdn_core.kcp.plan import Fragment, RankTable

from gdn_det_train_kcp.conv import causal_conv1d_det_kcp, causal_conv1d_det_kcp_simulated
from gdn_det_train_kcp.gdn import (
    DetKCPGrads,
    DetKCPSavedSet,
    DetKCPWorkspace,
    chunk_gated_delta_rule_det_kcp,
    chunk_gated_delta_rule_det_kcp_simulated,
    chunk_gdn_det_bwd_kcp,
    chunk_gdn_det_bwd_kcp_simulated,
    chunk_gdn_det_fwd_kcp,
    chunk_gdn_det_fwd_kcp_simulated,
)
from gdn_det_train_kcp.layers import GatedDeltaNetKCP
from gdn_det_train_kcp.plan import (
    DetKCPContext,
    DetKCPPlan,
    build_context_det_kcp,
    build_simulated_contexts_det_kcp,
    partition_det_kcp,
    update_context_det_kcp,
)

__version__ = "0.1.0"

__all__ = [
    "GatedDeltaNetKCP",
    "DetKCPContext",
    "DetKCPGrads",
    "DetKCPPlan",
    "DetKCPSavedSet",
    "DetKCPWorkspace",
    "Fragment",
    "RankTable",
    "build_context_det_kcp",
    "build_simulated_contexts_det_kcp",
    "causal_conv1d_det_kcp",
    "causal_conv1d_det_kcp_simulated",
    "chunk_gated_delta_rule_det_kcp",
    "chunk_gated_delta_rule_det_kcp_simulated",
    "chunk_gdn_det_bwd_kcp",
    "chunk_gdn_det_bwd_kcp_simulated",
    "chunk_gdn_det_fwd_kcp",
    "chunk_gdn_det_fwd_kcp_simulated",
    "partition_det_kcp",
    "update_context_det_kcp",
]

# Zero-argument entry points the import-independence checker runs.
__smoke__ = ["gdn_det_train_kcp.smoke:run"]
