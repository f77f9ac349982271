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

from gdn_det_train_kcp.plan import DetKCPContext

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


class DetKCPSavedSet(KCPSavedBase):
    """What :func:`chunk_gdn_det_bwd_kcp` needs from :func:`chunk_gdn_det_fwd_kcp`
    (one rank's): the context, the exchange mode, the local saved set, the
    folded initial state and the summaries the backward fold reads."""

    deterministic = True


class DetKCPGrads(KCPGradsBase):
    """Gradients of one rank's shard: ``dq, dk: [1,T,H,K]``, ``dv: [1,T,HV,V]``,
    ``dg, dbeta: [1,T,HV]``, in the inputs' dtypes."""

    deterministic = True


class DetKCPWorkspace(KCPWorkspaceBase):
    """Reusable buffers of :func:`chunk_gdn_det_bwd_kcp`: the exchange buffers and
    the local backward's workspace (rebuilt when the shard's layout changes).

    ``DetKCPWorkspace(world_size, HV, K, V, device=...)`` or
    ``DetKCPWorkspace.for_saved(saved)``. A backward given one of another
    world size, head layout or device (or of the non-deterministic package)
    raises ``ValueError``.
    """

    deterministic = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        register_handle(self)  # the custom ops reach it through a handle


_TYPES = dict(saved_cls=DetKCPSavedSet, workspace_cls=DetKCPWorkspace, grads_cls=DetKCPGrads)

# the package's custom ops (torch.ops.gdn_det_train_kcp.kcp_*); the differentiable calls
# route through them (torch.compile(fullgraph=True) traces them whole)
_OPS: KCPOps = define_kcp_ops("gdn_det_train_kcp", deterministic=True, context_cls=DetKCPContext,
                              **_TYPES)


def chunk_gdn_det_fwd_kcp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    context: DetKCPContext,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    exchange: str = "allgather",
    backend: str | None = None,
) -> tuple[torch.Tensor, DetKCPSavedSet]:
    """This rank's deterministic KCP forward → ``(o, saved)``.

    ``q, k: [1,T,H,K]``, ``v: [1,T,HV,V]``, ``g, beta: [1,T,HV]``: this rank's
    shard ``[start, stop)`` of the global packed sequence
    (``T = stop - start``, possibly 0). ``o: [1,T,HV,V]`` in v's dtype.
    ``exchange``: ``"allgather"`` (summaries all-gathered, each rank folds its
    predecessors) or ``"ring"`` (the fold carried rank to rank by
    point-to-point sends); same bits. ``backend``: as
    :func:`gdn_core.resolve_backend` (default: triton on CUDA, reference on
    CPU). All checks run before any communication.
    """
    return kcp_forward(q, k, v, g, beta, context, deterministic=True,
                       context_cls=DetKCPContext, saved_cls=DetKCPSavedSet, scale=scale,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
                       backend=backend)


def chunk_gdn_det_bwd_kcp(
    saved: DetKCPSavedSet,
    do: torch.Tensor,
    workspace: DetKCPWorkspace | None = None,
) -> DetKCPGrads:
    """This rank's deterministic KCP backward → :class:`DetKCPGrads`.

    Raises ``ValueError`` — before any communication — when ``saved`` is not a
    :class:`DetKCPSavedSet` (e.g. the non-deterministic package's), when
    ``workspace`` is not a fitting :class:`DetKCPWorkspace`, or when ``do``
    does not match the rank's output.
    """
    return kcp_backward(saved, do, workspace, deterministic=True, **_TYPES)


def chunk_gated_delta_rule_det_kcp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    context: DetKCPContext,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    exchange: str = "allgather",
    backend: str | None = None,
    workspace: DetKCPWorkspace | None = None,
) -> torch.Tensor:
    """Differentiable deterministic KCP GDN on this rank's shard → ``o [1,T,HV,V]``.

    Gradients flow to q, k, v, g and beta. The backward contains collectives:
    every rank's ``o`` must take part in the loss (or be backpropagated
    through) so that all ranks run it.
    """
    return _OPS.chunk_gated_delta_rule(q, k, v, g, beta, context, scale=scale,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                       exchange=exchange, backend=backend,
                                       workspace=workspace)


# ------------------------------------------------------------ simulated world --


def chunk_gdn_det_fwd_kcp_simulated(qs, ks, vs, gs, betas, contexts, *, scale=None,
                                    use_qk_l2norm_in_kernel=False, exchange="allgather",
                                    backend=None):
    """Every rank's forward of a simulated world, in this process → ``([o], [saved])``.

    ``contexts`` from :func:`~gdn_det_train_kcp.build_simulated_contexts_det_kcp`;
    ``qs[r]`` etc. rank ``r``'s shard. Same bits as the distributed run.
    """
    return kcp_forward_simulated(qs, ks, vs, gs, betas, contexts, deterministic=True,
                                 context_cls=DetKCPContext, saved_cls=DetKCPSavedSet,
                                 scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                 exchange=exchange, backend=backend)


def chunk_gdn_det_bwd_kcp_simulated(saveds, dos, workspaces=None) -> list[DetKCPGrads]:
    """Every rank's backward of a simulated world → ``[DetKCPGrads]``."""
    return kcp_backward_simulated(saveds, dos, workspaces, deterministic=True, **_TYPES)


def chunk_gated_delta_rule_det_kcp_simulated(qs, ks, vs, gs, betas, *, contexts, scale=None,
                                             use_qk_l2norm_in_kernel=False,
                                             exchange="allgather", backend=None):
    """Differentiable simulated world: every rank's shard in one process → ``[o]``."""
    return _OPS.chunk_gated_delta_rule_simulated(
        qs, ks, vs, gs, betas, contexts, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
        backend=backend)
