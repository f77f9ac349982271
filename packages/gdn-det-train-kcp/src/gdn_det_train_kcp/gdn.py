"""Deterministic context-parallel GDN: forward, backward, saved set, workspace, autograd.

Mode-typed wrappers over :mod:`gdn_core.kcp.compose` (read its docstring for
the algorithm). Everything is bitwise repeatable for a fixed world size and
plan: the local kernels run with ``deterministic=True``, the summaries are
folded in fp32 in a fixed order (:mod:`gdn_core.kcp.fold`, immune to TF32
settings), and ``exchange="allgather"`` and ``"ring"`` give the same bits.
With ``world_size == 1`` the result is bitwise the single-rank deterministic
one (:func:`gdn_core.chunk_gdn_fwd` / :func:`gdn_core.chunk_gdn_bwd` with
``deterministic=True``).

Every rank must call every function here (they contain collectives), in the
same order; a rank without tokens takes part and launches no kernel.
"""

from __future__ import annotations

from gdn_det_train_kcp._typed import DetKCPGrads, DetKCPSavedSet, DetKCPWorkspace
from gdn_det_train_kcp.ops import API

__all__ = [
    "DetKCPGrads",
    "DetKCPSavedSet",
    "DetKCPWorkspace",
    "chunk_gated_delta_rule_det_kcp",
    "chunk_gated_delta_rule_det_kcp_simulated",
    "chunk_gdn_det_bwd_kcp",
    "chunk_gdn_det_bwd_kcp_simulated",
    "chunk_gdn_det_fwd_kcp",
    "chunk_gdn_det_fwd_kcp_simulated",
]

chunk_gdn_det_fwd_kcp = API.fwd
chunk_gdn_det_bwd_kcp = API.bwd
chunk_gated_delta_rule_det_kcp = API.autograd
chunk_gdn_det_fwd_kcp_simulated = API.fwd_simulated
chunk_gdn_det_bwd_kcp_simulated = API.bwd_simulated
chunk_gated_delta_rule_det_kcp_simulated = API.autograd_simulated
