"""The deterministic KCP package's typed classes: plan, context, saved set, gradients, workspace."""

from __future__ import annotations

from gdn_core.custom_ops import register_handle
from gdn_core.kcp.compose import KCPGradsBase, KCPSavedBase, KCPWorkspaceBase
from gdn_core.kcp.context import KCPContext as CoreKCPContext
from gdn_core.kcp.plan import KCPPlan as CoreKCPPlan

__all__ = ["DetKCPPlan", "DetKCPContext", "DetKCPSavedSet", "DetKCPGrads", "DetKCPWorkspace"]


class DetKCPPlan(CoreKCPPlan):
    """A partition of a packed sequence over the ranks (deterministic package).

    ``token_range(rank)`` → ``(start, stop)``; ``fragments(rank)`` → the
    :class:`~gdn_core.kcp.plan.Fragment` s the rank holds (document, global and
    local offsets, ``prev_rank``/``next_rank`` and ``continues_from``/
    ``continues_into``); ``local_offsets(rank)``; ``rank_table(rank)`` (the
    exchange metadata); ``digest()``.
    """

    deterministic = True


class DetKCPContext(CoreKCPContext):
    """One rank's context of a :class:`DetKCPPlan` (:func:`build_context_det_kcp`).

    Host tables (``table``: :class:`~gdn_core.kcp.plan.RankTable`, conv halo
    tables) and their device copies (``cu_seqlens``, chunk indices), the
    process group and the device.
    """

    deterministic = True


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


for _cls in (DetKCPPlan, DetKCPContext, DetKCPSavedSet, DetKCPGrads, DetKCPWorkspace):
    _cls.__module__ = "gdn_det_train_kcp"
