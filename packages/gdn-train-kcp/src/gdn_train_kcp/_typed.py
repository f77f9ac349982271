"""The non-deterministic KCP package's typed classes: plan, context, saved set,
gradients, workspace."""

from __future__ import annotations

from gdn_core.custom_ops import register_handle
from gdn_core.kcp.compose import KCPGradsBase, KCPSavedBase, KCPWorkspaceBase
from gdn_core.kcp.context import KCPContext as CoreKCPContext
from gdn_core.kcp.plan import KCPPlan as CoreKCPPlan

__all__ = ["KCPPlan", "KCPContext", "KCPSavedSet", "KCPGrads", "KCPWorkspace"]


class KCPPlan(CoreKCPPlan):
    """A partition of a packed sequence over the ranks (non-deterministic package).

    ``token_range(rank)`` → ``(start, stop)``; ``fragments(rank)`` → the
    :class:`~gdn_core.kcp.plan.Fragment` s the rank holds (document, global and
    local offsets, ``prev_rank``/``next_rank`` and ``continues_from``/
    ``continues_into``); ``local_offsets(rank)``; ``rank_table(rank)`` (the
    exchange metadata); ``digest()``.
    """

    deterministic = False


class KCPContext(CoreKCPContext):
    """One rank's context of a :class:`KCPPlan` (:func:`build_context_kcp`).

    Host tables (``table``: :class:`~gdn_core.kcp.plan.RankTable`, conv halo
    tables) and their device copies (``cu_seqlens``, chunk indices), the
    process group and the device.
    """

    deterministic = False


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


for _cls in (KCPPlan, KCPContext, KCPSavedSet, KCPGrads, KCPWorkspace):
    _cls.__module__ = "gdn_train_kcp"
