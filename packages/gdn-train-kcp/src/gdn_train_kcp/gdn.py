"""Context-parallel GDN (non-deterministic mode): forward, backward, saved set,
workspace, autograd.

Mode-typed wrappers over :mod:`gdn_core.kcp.compose` (read its docstring for
the algorithm). The local kernels run with ``deterministic=False`` (fastest
configurations; atomics allowed), so results match the single-rank run within
tolerance but are not promised bitwise; the state fold itself is the same
fixed-order fp32 fold as in the deterministic package. Use
``gdn_det_train_kcp`` for bitwise-repeatable training.

Every rank must call every function here (they contain collectives), in the
same order; a rank without tokens takes part and launches no kernel.
"""

from __future__ import annotations

from gdn_train_kcp._typed import KCPGrads, KCPSavedSet, KCPWorkspace
from gdn_train_kcp.ops import API

__all__ = [
    "KCPGrads",
    "KCPSavedSet",
    "KCPWorkspace",
    "chunk_gated_delta_rule_kcp",
    "chunk_gated_delta_rule_kcp_simulated",
    "chunk_gdn_bwd_kcp",
    "chunk_gdn_bwd_kcp_simulated",
    "chunk_gdn_fwd_kcp",
    "chunk_gdn_fwd_kcp_simulated",
]

chunk_gdn_fwd_kcp = API.fwd
chunk_gdn_bwd_kcp = API.bwd
chunk_gated_delta_rule_kcp = API.autograd
chunk_gdn_fwd_kcp_simulated = API.fwd_simulated
chunk_gdn_bwd_kcp_simulated = API.bwd_simulated
chunk_gated_delta_rule_kcp_simulated = API.autograd_simulated
