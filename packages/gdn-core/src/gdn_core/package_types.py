"""The typed classes of the training packages, written once.

Each package has classes of its own (a deterministic package's workspace is not
the other package's: passing one to the other raises), that differ only in their
mode, their names and the package their docstrings point to. These factories
make them: :func:`single_rank_types` (saved set, workspace, gradients) and
:func:`kcp_types` (plan, context, saved set, gradients, workspace). Names:
``Det<Kind>`` / ``DetKCP<Kind>`` in the deterministic packages, ``<Kind>`` /
``KCP<Kind>`` in the others; ``__module__`` is the package, so they print,
pickle and document as the package's own.
"""

from __future__ import annotations

import functools

from gdn_core.autograd import TrainGrads, TrainSaved, TrainWorkspace

__all__ = ["kcp_types", "single_rank_types"]

_SINGLE_RANK_DOCS = {
    "SavedSet": """What :func:`{module}.chunk_gdn{sfx}_fwd` hands to
    :func:`{module}.chunk_gdn{sfx}_bwd` ({mode} mode only).

    Attributes: ``core`` (the :class:`gdn_core.GDNSaved` of the kernels),
    ``gate`` (the in-kernel gate's inputs, or ``None``); ``shapes``, ``device``,
    ``backend``. Treat it as opaque and use it for one backward (or several:
    it is not consumed).
    """,
    "Workspace": """Scratch buffers of :func:`{module}.chunk_gdn{sfx}_bwd`, allocated once.

    Size it with :meth:`for_shapes` (``T``, ``H``, ``K``, ``V``, ``HV``, ``B``,
    ``num_docs``, ``device``, ``dtype``) or :meth:`for_inputs` and pass it to
    every backward of a training loop. A problem larger than the workspace, of
    other head sizes, or on another device raises ``ValueError``.
    """,
    "Grads": """Gradients of a {mode} backward: ``dq, dk, dv, dg, dbeta, dh0`` and,
    with ``use_gate_in_kernel``, ``dA_log, ddt_bias`` (else ``None``).""",
}

_KCP_DOCS = {
    "Plan": """A partition of a packed sequence over the ranks ({mode} package).

    ``token_range(rank)`` → ``(start, stop)``; ``fragments(rank)`` → the
    :class:`~gdn_core.kcp.plan.Fragment` s the rank holds (document, global and
    local offsets, ``prev_rank``/``next_rank`` and ``continues_from``/
    ``continues_into``); ``local_offsets(rank)``; ``rank_table(rank)`` (the
    exchange metadata); ``digest()``.
    """,
    "Context": """One rank's context of a :class:`{prefix}KCPPlan` (:func:`build_context{sfx}_kcp`).

    Host tables (``table``: :class:`~gdn_core.kcp.plan.RankTable`, conv halo
    tables) and their device copies (``cu_seqlens``, chunk indices), the
    process group and the device.
    """,
    "SavedSet": """What :func:`chunk_gdn{sfx}_bwd_kcp` needs from :func:`chunk_gdn{sfx}_fwd_kcp`
    (one rank's): the context, the exchange mode, the local saved set, the
    folded initial state and the summaries the backward fold reads.""",
    "Grads": """Gradients of one rank's shard: ``dq, dk: [1,T,H,K]``, ``dv: [1,T,HV,V]``,
    ``dg, dbeta: [1,T,HV]``, in the inputs' dtypes.""",
    "Workspace": """Reusable buffers of :func:`chunk_gdn{sfx}_bwd_kcp`: the exchange buffers and
    the local backward's workspace (rebuilt when the shard's layout changes).

    ``{prefix}KCPWorkspace(world_size, HV, K, V, device=...)`` or
    ``{prefix}KCPWorkspace.for_saved(saved)``. A backward given one of another
    world size, head layout or device (or of the {other} package)
    raises ``ValueError``.
    """,
}


@functools.cache
def _handled_kcp_workspace() -> type:
    """The KCP workspace base whose instances the custom ops reach through a handle
    (registered when one is made); the KCP modules are imported only here, so a
    single-rank package does not load them."""
    from gdn_core.custom_ops import register_handle
    from gdn_core.kcp.compose import KCPWorkspaceBase

    class HandledKCPWorkspace(KCPWorkspaceBase):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            register_handle(self)

    HandledKCPWorkspace.__qualname__ = "HandledKCPWorkspace"
    return HandledKCPWorkspace


def _make(module: str, deterministic: bool, kinds: list[tuple[str, type]],
          docs: dict[str, str], fmt: dict[str, str]) -> tuple[type, ...]:
    """One subclass of each base in ``kinds`` (``(kind, base)``), named, documented and
    placed in ``module``."""
    classes = []
    for kind, base in kinds:
        name = fmt["prefix"] + fmt["infix"] + kind
        classes.append(type(name, (base,), {
            "__doc__": docs[kind].format(**fmt), "__module__": module, "__qualname__": name,
            "deterministic": deterministic,
        }))
    return tuple(classes)


def _fmt(module: str, deterministic: bool, infix: str) -> dict[str, str]:
    return dict(module=module, prefix="Det" if deterministic else "", infix=infix,
                sfx="_det" if deterministic else "",
                mode="deterministic" if deterministic else "non-deterministic",
                other="non-deterministic" if deterministic else "deterministic")


def single_rank_types(module: str, deterministic: bool) -> tuple[type, type, type]:
    """``(SavedSet, Workspace, Grads)`` of the single-rank package ``module`` (named
    ``Det…`` when ``deterministic``), subclasses of :mod:`gdn_core.autograd`'s."""
    kinds = [("SavedSet", TrainSaved), ("Workspace", TrainWorkspace), ("Grads", TrainGrads)]
    return _make(module, deterministic, kinds, _SINGLE_RANK_DOCS,
                 _fmt(module, deterministic, ""))


def kcp_types(module: str, deterministic: bool) -> tuple[type, type, type, type, type]:
    """``(KCPPlan, KCPContext, KCPSavedSet, KCPGrads, KCPWorkspace)`` of the KCP package
    ``module`` (named ``DetKCP…`` when ``deterministic``); the workspace registers a
    handle for the custom ops when it is made."""
    from gdn_core.kcp.compose import KCPGradsBase, KCPSavedBase
    from gdn_core.kcp.context import KCPContext
    from gdn_core.kcp.plan import KCPPlan

    kinds = [("Plan", KCPPlan), ("Context", KCPContext), ("SavedSet", KCPSavedBase),
             ("Grads", KCPGradsBase), ("Workspace", _handled_kcp_workspace())]
    return _make(module, deterministic, kinds, _KCP_DOCS, _fmt(module, deterministic, "KCP"))
