"""Context parallelism (KCP) for Gated DeltaNet: the math and plumbing both KCP packages share.

* :mod:`~gdn_core.kcp.plan` — partition plans (boundary policies, fragments,
  digest, host-side rank tables);
* :mod:`~gdn_core.kcp.context` — rank-local contexts (device tables, executor);
* :mod:`~gdn_core.kcp.summary` — per-fragment ``(M, S_ext)`` on both backends;
* :mod:`~gdn_core.kcp.fold` — the fixed-order IEEE-fp32 fold (and its transpose);
* :mod:`~gdn_core.kcp.exchange` — all-gather, ring and the simulated world;
* :mod:`~gdn_core.kcp.compose` — the KCP forward/backward over
  :func:`gdn_core.chunk_gdn_fwd` / :func:`gdn_core.chunk_gdn_bwd`;
* :mod:`~gdn_core.kcp.conv` — causal conv1d with the halo exchange;
* :mod:`~gdn_core.kcp.testing` — spawn a gloo world of processes (tests).

The training packages ``gdn_train_kcp`` and ``gdn_det_train_kcp`` wrap these
in their own mode-typed classes and public names (docs/context-parallel.md).
"""

import torch.distributed

if torch.distributed.is_available():
    # Imported before any process group exists, so that its functions' default arguments
    # (``group=group.WORLD``, evaluated at import) hold None rather than pinning a live
    # group past ``destroy_process_group()`` (the gloo exit abort: gdn_core.kcp.rankgroup).
    import torch.distributed.nn.functional  # noqa: F401

from gdn_core.kcp.compose import (
    EXCHANGES,
    KCPGradsBase,
    KCPSavedBase,
    KCPWorkspaceBase,
    kcp_backward,
    kcp_backward_simulated,
    kcp_forward,
    kcp_forward_simulated,
)
from gdn_core.kcp.context import ConvHalo, KCPContext, build_context, build_simulated_contexts
from gdn_core.kcp.conv import (
    ConvSaved,
    kcp_conv_backward,
    kcp_conv_backward_simulated,
    kcp_conv_forward,
    kcp_conv_forward_simulated,
)
from gdn_core.kcp.fold import fold_step
from gdn_core.kcp.plan import BOUNDARIES, Fragment, KCPPlan, RankTable, partition
from gdn_core.kcp.summary import fragment_summary

__all__ = [
    "BOUNDARIES",
    "EXCHANGES",
    "ConvHalo",
    "ConvSaved",
    "Fragment",
    "KCPContext",
    "KCPGradsBase",
    "KCPPlan",
    "KCPSavedBase",
    "KCPWorkspaceBase",
    "RankTable",
    "build_context",
    "build_simulated_contexts",
    "fold_step",
    "fragment_summary",
    "kcp_backward",
    "kcp_backward_simulated",
    "kcp_conv_backward",
    "kcp_conv_backward_simulated",
    "kcp_conv_forward",
    "kcp_conv_forward_simulated",
    "kcp_forward",
    "kcp_forward_simulated",
    "partition",
]
