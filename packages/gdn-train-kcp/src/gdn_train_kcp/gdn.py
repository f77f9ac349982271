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

import torch
from gdn_core.custom_ops import register_handle
from gdn_core.kcp.compose import (
    KCPGradsBase,
    KCPSavedBase,
    KCPWorkspaceBase,
    kcp_backward,
    kcp_backward_simulated,
    kcp_forward,
    kcp_forward_simulated,
)
from gdn_core.kcp_ops import KCPOps, define_kcp_ops

from gdn_train_kcp.plan import KCPContext

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


class KCPSavedSet(KCPSavedBase):
    """What :func:`chunk_gdn_bwd_kcp` needs from :func:`chunk_gdn_fwd_kcp`
    (one rank's): the context, the exchange mode, the local saved set, the
    folded initial state and the summaries the backward fold reads."""

    deterministic = False


class KCPGrads(KCPGradsBase):
    """Gradients of one rank's shard: ``dq, dk: [1,T,H,K]``, ``dv: [1,T,HV,V]``,
    ``dg, dbeta: [1,T,HV]``, in the inputs' dtypes."""

    deterministic = False


class KCPWorkspace(KCPWorkspaceBase):
    """Reusable buffers of :func:`chunk_gdn_bwd_kcp`: the exchange buffers and
    the local backward's workspace (rebuilt when the shard's layout changes).

    ``KCPWorkspace(world_size, HV, K, V, device=...)`` or
    ``KCPWorkspace.for_saved(saved)``. A backward given one of another
    world size, head layout or device (or of the deterministic package)
    raises ``ValueError``.
    """

    deterministic = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        register_handle(self)  # the custom ops reach it through a handle


_TYPES = dict(saved_cls=KCPSavedSet, workspace_cls=KCPWorkspace, grads_cls=KCPGrads)

# the package's custom ops (torch.ops.gdn_train_kcp.kcp_*); the differentiable calls
# route through them (torch.compile(fullgraph=True) traces them whole)
_OPS: KCPOps = define_kcp_ops("gdn_train_kcp", deterministic=False, context_cls=KCPContext,
                              **_TYPES)


def chunk_gdn_fwd_kcp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    context: KCPContext,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    exchange: str = "allgather",
    backend: str | None = None,
) -> tuple[torch.Tensor, KCPSavedSet]:
    """This rank's KCP forward → ``(o, saved)``.

    ``q, k: [1,T,H,K]``, ``v: [1,T,HV,V]``, ``g, beta: [1,T,HV]``: this rank's
    shard ``[start, stop)`` of the global packed sequence
    (``T = stop - start``, possibly 0). ``o: [1,T,HV,V]`` in v's dtype.
    ``exchange``: ``"allgather"`` (summaries all-gathered, each rank folds its
    predecessors) or ``"ring"`` (the fold carried rank to rank by
    point-to-point sends). ``backend``: as
    :func:`gdn_core.resolve_backend` (default: triton on CUDA, reference on
    CPU). All checks run before any communication.
    """
    return kcp_forward(q, k, v, g, beta, context, deterministic=False,
                       context_cls=KCPContext, saved_cls=KCPSavedSet, scale=scale,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
                       backend=backend)


def chunk_gdn_bwd_kcp(
    saved: KCPSavedSet,
    do: torch.Tensor,
    workspace: KCPWorkspace | None = None,
) -> KCPGrads:
    """This rank's KCP backward → :class:`KCPGrads`.

    Raises ``ValueError`` — before any communication — when ``saved`` is not a
    :class:`KCPSavedSet` (e.g. the deterministic package's), when
    ``workspace`` is not a fitting :class:`KCPWorkspace`, or when ``do``
    does not match the rank's output.
    """
    return kcp_backward(saved, do, workspace, deterministic=False, **_TYPES)


def chunk_gated_delta_rule_kcp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    context: KCPContext,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    exchange: str = "allgather",
    backend: str | None = None,
    workspace: KCPWorkspace | None = None,
) -> torch.Tensor:
    """Differentiable KCP GDN on this rank's shard → ``o [1,T,HV,V]``.

    Gradients flow to q, k, v, g and beta. The backward contains collectives:
    every rank's ``o`` must take part in the loss (or be backpropagated
    through) so that all ranks run it.
    """
    return _OPS.chunk_gated_delta_rule(q, k, v, g, beta, context, scale=scale,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                       exchange=exchange, backend=backend,
                                       workspace=workspace)


# ------------------------------------------------------------ simulated world --


def chunk_gdn_fwd_kcp_simulated(qs, ks, vs, gs, betas, contexts, *, scale=None,
                                    use_qk_l2norm_in_kernel=False, exchange="allgather",
                                    backend=None):
    """Every rank's forward of a simulated world, in this process → ``([o], [saved])``.

    ``contexts`` from :func:`~gdn_train_kcp.build_simulated_contexts_kcp`;
    ``qs[r]`` etc. rank ``r``'s shard.
    """
    return kcp_forward_simulated(qs, ks, vs, gs, betas, contexts, deterministic=False,
                                 context_cls=KCPContext, saved_cls=KCPSavedSet,
                                 scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                 exchange=exchange, backend=backend)


def chunk_gdn_bwd_kcp_simulated(saveds, dos, workspaces=None) -> list[KCPGrads]:
    """Every rank's backward of a simulated world → ``[KCPGrads]``."""
    return kcp_backward_simulated(saveds, dos, workspaces, deterministic=False, **_TYPES)


def chunk_gated_delta_rule_kcp_simulated(qs, ks, vs, gs, betas, *, contexts, scale=None,
                                             use_qk_l2norm_in_kernel=False,
                                             exchange="allgather", backend=None):
    """Differentiable simulated world: every rank's shard in one process → ``[o]``."""
    return _OPS.chunk_gated_delta_rule_simulated(
        qs, ks, vs, gs, betas, contexts, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
        backend=backend)
