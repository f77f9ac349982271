"""Partition plans and rank contexts of the deterministic KCP package.

Thin, mode-typed wrappers over :mod:`gdn_core.kcp.plan` and
:mod:`gdn_core.kcp.context` (the shared logic lives there).
"""

from __future__ import annotations

from typing import Any

import torch
from gdn_core.chunking import CHUNK_SIZE
from gdn_core.custom_ops import register_handle
from gdn_core.kcp.context import KCPContext, build_context, build_simulated_contexts
from gdn_core.kcp.plan import DEFAULT_DOC_SLACK, Fragment, KCPPlan, RankTable, partition
from gdn_core.kcp_ops import attach_static_layout, rebind_static_context

__all__ = [
    "DetKCPContext",
    "DetKCPPlan",
    "Fragment",
    "RankTable",
    "build_context_det_kcp",
    "build_simulated_contexts_det_kcp",
    "partition_det_kcp",
    "update_context_det_kcp",
]


class DetKCPPlan(KCPPlan):
    """A partition of a packed sequence over the ranks (deterministic package).

    ``token_range(rank)`` → ``(start, stop)``; ``fragments(rank)`` → the
    :class:`~gdn_core.kcp.plan.Fragment` s the rank holds (document, global and
    local offsets, ``prev_rank``/``next_rank`` and ``continues_from``/
    ``continues_into``); ``local_offsets(rank)``; ``rank_table(rank)`` (the
    exchange metadata); ``digest()``.
    """

    deterministic = True


class DetKCPContext(KCPContext):
    """One rank's context of a :class:`DetKCPPlan` (:func:`build_context_det_kcp`).

    Host tables (``table``: :class:`~gdn_core.kcp.plan.RankTable`, conv halo
    tables) and their device copies (``cu_seqlens``, chunk indices), the
    process group and the device.
    """

    deterministic = True


def partition_det_kcp(
    cu_seqlens: torch.Tensor | list[int],
    world_size: int,
    *,
    chunk_size: int = CHUNK_SIZE,
    boundary: str = "chunk",
    segment_size: int | None = None,
    doc_slack: float = DEFAULT_DOC_SLACK,
) -> DetKCPPlan:
    """Cut the packed sequence over ``world_size`` ranks → :class:`DetKCPPlan`.

    Pure CPU and deterministic; ``cu_seqlens`` a list or 1-D int tensor of the
    global packed sequence. ``boundary``:

    * ``"even"`` — balanced token counts (loads differ by at most one token);
    * ``"chunk"`` (default) — every cut on a chunk boundary of the document it
      splits (each fragment keeps the single-rank chunk grid), within
      ``chunk_size/2`` of the balanced position;
    * ``"doc"`` — cut at document boundaries; split a document (on a chunk
      boundary) only when no boundary lies within ``doc_slack·T/world_size`` of
      the balanced position;
    * ``"segment"`` — cut only at document starts or on ``segment_size``
      boundaries of a document (default 4096 tokens).

    Any ``world_size >= 1`` and any total length work; ranks may get no token.
    """
    return partition(cu_seqlens, world_size, chunk_size=chunk_size, boundary=boundary,
                     segment_size=segment_size, doc_slack=doc_slack, plan_cls=DetKCPPlan)


def build_context_det_kcp(
    plan: DetKCPPlan,
    rank: int,
    *,
    group: Any = None,
    device: torch.device | str | None = None,
    conv_kernel_size: int | None = None,
    max_docs: int | None = None,
    max_chunks: int | None = None,
    heads: tuple[int, int] | None = None,
    head_dims: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    exchange: str | None = None,
) -> DetKCPContext:
    """Rank ``rank``'s :class:`DetKCPContext` of ``plan``.

    ``group``: the ``torch.distributed`` process group (``None``: the default
    group when ``world_size > 1``; no communication at all for one rank).
    With a group, one small all-gather (once, here) compares what every rank
    must agree on — the world size and ranks, the plan (mode, boundary, chunk
    and segment sizes, digest), ``conv_kernel_size`` and the declared calls —
    so call it on all ranks: a disagreement raises the same ``ValueError`` on
    every rank within the collective (no timeout), and a rank whose own
    arguments are bad raises its error while its peers raise a ``ValueError``
    naming it. ``device``: where this rank's tensors live (default: the current
    CUDA device with NCCL, else the CPU; ``ValueError`` for a device this
    process cannot use, e.g. ``"cuda"`` without CUDA). ``conv_kernel_size``
    prebuilds the conv halo tables (else built at the first conv call).

    ``heads=(H, HV)``, ``head_dims=(K, V)``, ``dtype`` (of q, k, v, g, beta) and
    ``exchange`` declare what this rank's GDN calls will use (``None``: not
    declared). Declare them to have the ranks checked against each other here;
    a later call that differs from the declaration raises ``ValueError`` before
    any collective.

    ``max_docs`` (world of one only) makes the context *static*, for CUDA
    graphs: the differentiable calls then run over fixed-size device tables of
    up to ``max_docs`` documents and ``max_chunks`` chunks (default: enough for
    any layout of the shard's length), and :func:`update_context_det_kcp` points
    the same context — the same device buffers — at the next batch's plan
    (see :mod:`gdn_core.kcp_ops`).
    """
    ctx = build_context(plan, rank, group=group, device=device,
                        conv_kernel_size=conv_kernel_size, heads=heads, head_dims=head_dims,
                        dtype=dtype, exchange=exchange, plan_cls=DetKCPPlan,
                        context_cls=DetKCPContext)
    if max_docs is not None or max_chunks is not None:
        if max_docs is None:
            raise ValueError("max_chunks needs max_docs (a static context's document capacity)")
        attach_static_layout(ctx, max_docs=max_docs, max_chunks=max_chunks)
    register_handle(ctx)  # the custom ops reach the context through a handle
    return ctx


def update_context_det_kcp(context: DetKCPContext, plan: DetKCPPlan) -> DetKCPContext:
    """Point a static context (``build_context_det_kcp(..., max_docs=...)``) at ``plan``
    — a world of one over the same number of tokens, within the capacities — in
    place, so that a training step captured in a CUDA graph with the old plan
    replays for the new one. Returns ``context``. Not during a capture."""
    return rebind_static_context(context, plan, plan_cls=DetKCPPlan, context_cls=DetKCPContext)


def build_simulated_contexts_det_kcp(
    plan: DetKCPPlan,
    *,
    device: torch.device | str | None = None,
    conv_kernel_size: int | None = None,
    heads: tuple[int, int] | None = None,
    head_dims: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    exchange: str | None = None,
) -> list[DetKCPContext]:
    """The contexts of *all* ranks of ``plan`` for a simulated world in one process
    (no process group): run them with the ``*_simulated`` functions. ``heads``,
    ``head_dims``, ``dtype``, ``exchange``: declared for every rank, as in the
    rank context's build."""
    ctxs = build_simulated_contexts(plan, device=device, conv_kernel_size=conv_kernel_size,
                                    heads=heads, head_dims=head_dims, dtype=dtype,
                                    exchange=exchange,
                                    plan_cls=DetKCPPlan, context_cls=DetKCPContext)
    for ctx in ctxs:
        register_handle(ctx)
    return ctxs
