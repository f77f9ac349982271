"""Rank-local contexts: a plan turned into what one rank's kernels and exchanges need.

A :class:`KCPContext` holds the host-side tables of its rank (the
:class:`~gdn_core.kcp.plan.RankTable`, conv halo tables) and their device
copies (local ``cu_seqlens``, chunk indices), so that neither forward nor
backward reads a device tensor on the host. It also fixes the executor of the
exchanges: a ``torch.distributed`` process group, the world of one rank, or a
*simulated* world (all ranks in this process, see
:func:`gdn_core.kcp.exchange.drive_simulated`).

The training packages subclass :class:`KCPContext` per mode
(``deterministic``) and build it with :func:`build_context` /
:func:`build_simulated_contexts`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from gdn_core.chunking import ChunkIndex, chunk_index
from gdn_core.devices import require_device
from gdn_core.kcp.agree import RunSpec, agreement_error, exchange_records, make_record
from gdn_core.kcp.exchange import LocalExchange, ProcessGroupExchange
from gdn_core.kcp.plan import KCPPlan, RankTable
from gdn_core.typed import ModeTyped, require_instance

__all__ = [
    "ConvHalo",
    "KCPContext",
    "build_context",
    "build_simulated_contexts",
    "seg_exchange_rows",
]


@dataclass(frozen=True)
class ConvHalo:
    """Halo tables of a causal conv1d of width ``kernel_size`` for one rank.

    Every rank sends its *tail* (its last ``h = kernel_size - 1`` tokens,
    zero-padded in front when it holds fewer) in an all-gather
    ``[world, h, D]``; flattened with one zero row appended
    (``[world·h + 1, D]``), ``src[j]`` is the row holding the ``j``-th halo
    token (the ``h`` tokens before this shard; the zero row where they lie
    before the document's start, or when the first fragment does not
    continue). In backward, ``inv[p]`` (``[world·h]``) is the halo position
    whose gradient goes to gathered row ``p`` (``h``: none — a zero row of the
    gradient extended by one). ``valid``: how many halo tokens are real.
    """

    kernel_size: int
    valid: int
    src: tuple[int, ...]
    inv: tuple[int, ...]
    src_t: torch.Tensor
    inv_t: torch.Tensor

    @property
    def width(self) -> int:
        return self.kernel_size - 1


def _conv_halo(plan: KCPPlan, table: RankTable, kernel_size: int, device) -> ConvHalo:
    h = kernel_size - 1
    W = plan.world_size
    dummy = W * h
    src = [dummy] * h
    valid = 0
    if table.first_continues and h > 0:
        first = plan.fragments(table.rank)[0]
        valid = min(h, first.offset_in_doc)
        gstart = table.start
        for j in range(h - valid, h):
            p = gstart - h + j  # global position of halo token j
            s = _owner(plan, p)
            stop_s = plan.cuts[s + 1]
            src[j] = s * h + (h - (stop_s - p))
    inv = [h] * (W * h)
    for j, p in enumerate(src):
        if p != dummy:
            inv[p] = j

    def dev(x):
        return torch.tensor(x, dtype=torch.int64).to(device)

    return ConvHalo(kernel_size, valid, tuple(src), tuple(inv), dev(src), dev(inv))


def _owner(plan: KCPPlan, p: int) -> int:
    """The rank holding global token ``p`` (the non-empty shard containing it)."""
    for s in range(plan.world_size):
        if plan.cuts[s] <= p < plan.cuts[s + 1]:
            return s
    raise ValueError(f"token {p} lies outside the plan")  # pragma: no cover


@dataclass(eq=False)
class KCPContext(ModeTyped):
    """One rank's view of a plan (see the module docstring).

    Attributes:
        plan: the :class:`KCPPlan`; rank, world_size: this rank in it.
        table: host-side exchange metadata (:class:`RankTable`).
        device: where this rank's tensors live.
        group: the process group (``None`` for one rank or a simulated world); held
            weakly, so that a context kept to the end of a script does not keep its group
            (and gloo's threads) alive past ``destroy_process_group()``; reading it after
            the group was destroyed raises ``RuntimeError``.
        simulated: part of a simulated world (use the ``*_simulated`` calls).
        cu_seqlens: local document offsets, int32 on ``device`` (``[0, 0]``
            for an empty rank).
        index / first_index / last_index: chunk tables of the shard, of its
            first fragment alone and of its last fragment alone (``None`` for
            an empty rank).
        segments / seg_index: ``"segment"`` plans: the shard's
            :class:`~gdn_core.segment.SegmentLayout` (continuation flags from
            the table) and its segment-level chunk table (``None`` otherwise
            and for an empty rank).
        seg_slots: rows per rank of the segment-summary all-gather.
        seg_prefix_rows: rows of the flattened all-gather ``[world·seg_slots]``
            holding the earlier ranks' segments of the first fragment's
            document, in document order; seg_suffix_rows: the later ranks'
            segments of the last fragment's document, last segment first.
        spec: what the build declared about the GDN calls
            (:class:`~gdn_core.kcp.agree.RunSpec`, ``None`` for nothing).
    """

    plan: KCPPlan
    rank: int
    table: RankTable
    device: torch.device
    group_ref: weakref.ref | None = field(default=None, repr=False)
    simulated: bool = False
    cu_seqlens: torch.Tensor | None = None
    index: ChunkIndex | None = None
    first_index: ChunkIndex | None = None
    last_index: ChunkIndex | None = None
    segments: Any = None
    seg_index: ChunkIndex | None = None
    seg_slots: int = 0
    seg_prefix_rows: tuple[int, ...] = ()
    seg_suffix_rows: tuple[int, ...] = ()
    spec: RunSpec | None = None
    _halos: dict[int, ConvHalo] = field(default_factory=dict, repr=False)
    #: call signatures every rank of the group agreed on (:mod:`gdn_core.kcp.agree`)
    agreed_calls: set = field(default_factory=set, repr=False)

    @property
    def group(self) -> Any:
        """The process group (``None`` for one rank or a simulated world).

        Raises ``RuntimeError`` once the group was destroyed.
        """
        if self.group_ref is None:
            return None
        group = self.group_ref()
        if group is None:
            raise RuntimeError(
                "the process group this KCP context was built on has been destroyed "
                "(destroy_process_group); build a new context on a live group"
            )
        return group

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def num_tokens(self) -> int:
        return self.table.num_tokens

    @property
    def local_offsets(self) -> tuple[int, ...]:
        """Host ``cu_seqlens`` of the shard (``(0, 0)`` for an empty rank)."""
        offs = self.table.local_offsets
        return offs if len(offs) > 1 else (0, 0)

    def token_range(self) -> tuple[int, int]:
        return self.table.start, self.table.stop

    def conv_halo(self, kernel_size: int) -> ConvHalo:
        """Halo tables for a conv of width ``kernel_size`` (built once, then cached)."""
        if kernel_size not in self._halos:
            self._halos[kernel_size] = _conv_halo(self.plan, self.table, kernel_size, self.device)
        return self._halos[kernel_size]

    def check_call(self, *, H: int, HV: int, K: int, V: int, dtype: torch.dtype,
                   exchange: str) -> None:
        """Raise ``ValueError`` if a GDN call's heads, head dimensions, dtype or exchange
        differ from what the build declared (:attr:`spec`); nothing to check without one."""
        if self.spec is not None:
            self.spec.check_call(H=H, HV=HV, K=K, V=V, dtype=dtype, exchange=exchange)

    def executor(self):
        """The executor of this rank's exchanges (not for a simulated world)."""
        if self.simulated:
            raise ValueError(
                "this context belongs to a simulated world: run all its ranks together with "
                "the *_simulated functions"
            )
        if self.world_size == 1:
            return LocalExchange()
        return ProcessGroupExchange(self.group, self.rank, self.world_size)

    def __repr__(self) -> str:
        t = self.table
        return (f"{type(self).__qualname__}(rank={self.rank}/{self.world_size}, "
                f"tokens=[{t.start}, {t.stop}), fragments={t.num_fragments}, "
                f"first_continues={t.first_continues}, last_continues={t.last_continues}, "
                f"device={self.device}, simulated={self.simulated})")


def _device(device, group) -> torch.device:
    if device is not None:
        device = require_device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if group is not None:
        import torch.distributed as dist

        if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_conv_kernel_size(conv_kernel_size: Any) -> None:
    if conv_kernel_size is not None and (isinstance(conv_kernel_size, bool) or not isinstance(
            conv_kernel_size, int) or conv_kernel_size < 1):
        raise ValueError(f"conv_kernel_size must be an int >= 1, got {conv_kernel_size!r}")


def _make(plan, rank, device, group, simulated, conv_kernel_size, context_cls) -> KCPContext:
    table = plan.rank_table(rank)
    index = first_index = last_index = None
    offs = table.local_offsets if table.num_fragments else (0, 0)
    if table.num_fragments:
        index = chunk_index(offs, device)
        first_index = chunk_index((0, table.first_length), device)
        last_index = chunk_index((0, table.num_tokens - table.last_start), device)
    ctx = context_cls(
        plan=plan, rank=rank, table=table, device=device,
        group_ref=None if group is None else weakref.ref(group), simulated=simulated,
        cu_seqlens=torch.tensor(offs, dtype=torch.int32).to(device),
        index=index, first_index=first_index, last_index=last_index,
    )
    if plan.boundary == "segment":
        _segment_tables(ctx, plan, table, device)
    if conv_kernel_size is not None:
        _check_conv_kernel_size(conv_kernel_size)
        ctx.conv_halo(conv_kernel_size)
    return ctx


def _segment_tables(ctx: KCPContext, plan: KCPPlan, table: RankTable, device) -> None:
    """The segment layout and exchange rows of a ``"segment"`` plan's rank."""
    from gdn_core.segment import SegmentLayout

    S = plan.segment_size
    cap = plan.segment_slots()
    ctx.seg_slots = cap
    frags = plan.fragments(table.rank)
    if not frags:
        return
    for f in frags:
        if f.offset_in_doc % S:  # pragma: no cover - guaranteed by the policy
            raise ValueError(f"fragment {f} does not start on its document's segment grid")
    ctx.segments = SegmentLayout.build(table.local_offsets, S,
                                       first_continues=table.first_continues,
                                       last_continues=table.last_continues)
    ctx.seg_index = ctx.segments.index(device)
    prefix: list[int] = []
    for p in table.fwd_chain:
        n = plan.fragment_segments(plan.fragments(p)[-1])
        prefix.extend(p * cap + i for i in range(n))
    suffix: list[int] = []
    for p in reversed(table.bwd_chain):
        n = plan.fragment_segments(plan.fragments(p)[0])
        suffix.extend(p * cap + (n - 1 - i) for i in range(n))
    ctx.seg_prefix_rows = tuple(prefix)
    ctx.seg_suffix_rows = tuple(suffix)
    # their device copies, made now (one copy, cached) rather than between kernels of a step
    seg_exchange_rows(ctx, device)


def seg_exchange_rows(ctx: KCPContext, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seg_prefix_rows, seg_suffix_rows)`` of ``ctx`` as int64 tensors on ``device``
    (cached by value: :func:`gdn_core.hostcache.device_int_tables`)."""
    from gdn_core.hostcache import device_int_tables

    return device_int_tables((ctx.seg_prefix_rows, ctx.seg_suffix_rows), device, torch.int64)


def _default_group(plan: Any) -> Any:
    """The process group of a build without ``group=``: the default group for a plan of
    several ranks (it must be initialised), none for a world of one. A rank whose
    ``plan`` is not a plan still joins an initialised default group, so that its peers
    learn of its error instead of waiting for it."""
    import torch.distributed as dist

    ready = dist.is_available() and dist.is_initialized()
    world = plan.world_size if isinstance(plan, KCPPlan) else None
    if world == 1 or (world is None and not ready):
        return None
    if not ready:
        raise ValueError(
            f"a plan for world_size={world} needs a torch.distributed process "
            f"group (initialise one, or pass group=...); to run all ranks in one process "
            f"use the simulated contexts"
        )
    return dist.group.WORLD


def _comm_device(group: Any) -> torch.device:
    """Where a collective's tensors must live for ``group``'s backend."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class _Checked:
    """The outcome of one rank's own checks of a context build."""

    plan: KCPPlan | None = None
    device: torch.device | None = None
    spec: RunSpec | None = None
    error: Exception | None = None


def _local_checks(plan, rank, group, device, conv_kernel_size, spec_args: dict,
                  plan_cls: type) -> _Checked:
    """Every check one rank can make alone. An error is kept, not raised, so that
    :func:`_agree` tells the peers first."""
    out = _Checked()
    try:
        out.plan = require_instance(plan, plan_cls, "plan")
        out.plan._check_rank(rank)
        _check_conv_kernel_size(conv_kernel_size)
        out.spec = RunSpec.make(**spec_args)
        out.device = _device(device, group)
    except (TypeError, ValueError) as err:
        out.error = err
    return out


def _agree(checked: _Checked, rank: Any, group: Any, conv_kernel_size: Any) -> None:
    """One all-gather of every rank's record (:mod:`gdn_core.kcp.agree`); raises this
    rank's own error, or the ``ValueError`` every rank raises on a disagreement."""
    import torch.distributed as dist

    record = make_record(checked.plan, rank, dist.get_rank(group), conv_kernel_size,
                         checked.spec, checked.error is not None)
    message = agreement_error(exchange_records(record, group, _comm_device(group)))
    if checked.error is not None:
        raise checked.error
    if message is not None:
        raise ValueError(message)


def build_context(
    plan: KCPPlan,
    rank: int,
    *,
    group: Any = None,
    device: torch.device | str | None = None,
    conv_kernel_size: int | None = None,
    heads: tuple[int, int] | None = None,
    head_dims: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    exchange: str | None = None,
    plan_cls: type[KCPPlan] = KCPPlan,
    context_cls: type[KCPContext] = KCPContext,
) -> KCPContext:
    """Rank ``rank``'s context of ``plan``.

    ``group``: a ``torch.distributed`` process group; ``None`` means the
    default group when ``plan.world_size > 1`` (it must be initialised) and no
    communication at all for a world of one. With a group, every rank's record
    (world size, rank, plan, conv width, declared calls: :mod:`gdn_core.kcp.agree`)
    is all-gathered once and compared: a disagreement raises the same
    ``ValueError`` on every rank, and a rank whose own arguments are bad raises
    its error while its peers raise a ``ValueError`` naming it. ``device``:
    where the rank's tensors live (default: the current CUDA device for an NCCL
    group, else the CPU; ``ValueError`` for a device this process cannot use).
    ``heads=(H, HV)``, ``head_dims=(K, V)``, ``dtype``, ``exchange``: what this
    rank's GDN calls will use (:class:`~gdn_core.kcp.agree.RunSpec`; ``None``:
    not declared) — agreed on here, and a call that differs raises ``ValueError``
    before any collective.
    """
    spec_args = dict(heads=heads, head_dims=head_dims, dtype=dtype, exchange=exchange)
    if group is None:
        group = _default_group(plan)
    checked = _local_checks(plan, rank, group, device, conv_kernel_size, spec_args, plan_cls)
    if group is not None:
        _agree(checked, rank, group, conv_kernel_size)
    elif checked.error is not None:
        raise checked.error
    ctx = _make(checked.plan, rank, checked.device, group, False, conv_kernel_size, context_cls)
    ctx.spec = checked.spec
    return ctx


def build_simulated_contexts(
    plan: KCPPlan,
    *,
    device: torch.device | str | None = None,
    conv_kernel_size: int | None = None,
    heads: tuple[int, int] | None = None,
    head_dims: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    exchange: str | None = None,
    plan_cls: type[KCPPlan] = KCPPlan,
    context_cls: type[KCPContext] = KCPContext,
) -> list[KCPContext]:
    """The contexts of every rank of ``plan`` for a simulated world in this process
    (``heads``, ``head_dims``, ``dtype``, ``exchange``: as in :func:`build_context`,
    the same declaration for every rank)."""
    plan = require_instance(plan, plan_cls, "plan")
    _check_conv_kernel_size(conv_kernel_size)
    spec = RunSpec.make(heads=heads, head_dims=head_dims, dtype=dtype, exchange=exchange)
    dev = _device(device, None)
    ctxs = [_make(plan, r, dev, None, True, conv_kernel_size, context_cls)
            for r in range(plan.world_size)]
    for ctx in ctxs:
        ctx.spec = spec
    return ctxs
