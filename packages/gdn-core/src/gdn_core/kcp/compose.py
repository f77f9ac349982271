"""KCP forward and backward: summaries, exchange, fold, local kernels.

**Forward** of rank ``r`` (shard ``[start, stop)``, fragments from the plan):

1. If its last fragment continues into a later rank, summarise that fragment:
   ``(M, S_ext)`` (:func:`~gdn_core.kcp.summary.fragment_summary`; ``M`` only
   when the fragment is a *pass-through* — it is the rank's only fragment and
   it also continues from an earlier rank; otherwise the fragment starts from
   zero and ``S_ext`` is its final state).
2. Exchange and fold (:mod:`~gdn_core.kcp.fold`, fp32, fixed order) to get
   ``S_in``, the true initial state of the first fragment when it continues
   from an earlier rank. ``"allgather"``: every rank contributes one slot
   ``[HV, K, K+V]`` (``[M | S_ext]``; identity and zeros when it has no
   summary) and folds the slots of its fold chain — the document's start rank
   seeds ``S = S_ext``, every pass-through rank after it applies
   ``S ← M S + S_ext``. ``"ring"``: the same steps, carried rank to rank by
   point-to-point sends (``[HV, K, V]`` per hop; every rank sends and
   receives, ranks without tokens forward the carry unchanged). Both give the
   same bits.
3. Run the ordinary local forward (:func:`gdn_core.compose.chunk_gdn_fwd`)
   on the shard's documents, with ``S_in`` as the first fragment's initial
   state. A rank with no tokens launches nothing. With nothing continuing
   (one rank) the call is exactly the single-rank one: bitwise equal.

**Backward** (the mirror). ``D(r)``: the gradient w.r.t. the final state of
rank ``r``'s last fragment, which is ``dS_in`` of the next rank holding that
document. ``dS_in(r) = dS_loc(r) + Mᵀ D(r)`` for a pass-through rank, else
``dS_loc(r)``, with ``dS_loc`` the first fragment's initial-state gradient at
``D = 0``. So each rank

1. computes ``dS_loc`` when its first fragment continues: from the local
   backward itself when its last fragment does not continue (no extra work),
   else by an extra backward over the first fragment only (for a pass-through
   rank that is the whole shard: the cost of a second local backward);
2. exchanges and folds from later ranks in fixed order (``"allgather"`` of
   ``dS_loc`` slots, folding ``X ← Mᵀ X + dS_loc`` from the document's last
   rank down, with the ``M`` slots gathered in forward; or the reverse ring);
3. runs the local backward with ``dht = D(r)`` for its last fragment.

**Segment plans** (``boundary="segment"``, partition-invariant). Every rank
runs the single-rank segment path of :mod:`gdn_core.segment` on its own
segments — the very functions ``chunk_gdn_fwd``/``chunk_gdn_bwd`` run — with
the exchange between its phases:

* forward: summaries of the local segments; ``"allgather"`` of fixed slots
  ``[seg_slots, HV, K, V+K]`` per rank (the ``[E | M]`` of the last fragment's
  segments when it continues, zeros otherwise; ``seg_slots`` is a function of
  the plan's total length, world size and segment size), after which each
  rank prepends the earlier ranks' segments of its first document to that
  document's fold chain — the chain the single-rank path folds, step for
  step; ``"ring"``: the state leaving each rank's last segment is carried to
  the next (``[HV, K, V]``), each rank continuing the fold over its own
  segments. Then the local segments' recurrences from their entry states.
* backward: the first reverse pass over the local segments, the ``[P | M]``
  rows of the first fragment's segments exchanged (or the reverse ring), the
  transposed fold, the full local backward.

Every fold step and every segment's kernels see the same inputs as in the
single-rank run, so outputs and gradients are bitwise those of
``chunk_gdn_fwd``/``chunk_gdn_bwd`` with the plan's ``segment_size`` — for
any world size, both exchanges, a simulated world or processes.

Each rank's algorithm is a generator (see :mod:`~gdn_core.kcp.exchange`): the
same code runs over a process group, in a world of one, and in a simulated
world in one process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gdn_core.compose import GDNGrads, GDNSaved, chunk_gdn_bwd, chunk_gdn_fwd, resolve_backend
from gdn_core.kcp.agree import (
    backward_agreement_error,
    call_agreement_error,
    call_signature,
    exchange_records,
    make_backward_record,
    make_call_record,
)
from gdn_core.kcp.context import KCPContext, seg_exchange_rows
from gdn_core.kcp.exchange import AllGather, RingPass, drive, drive_simulated
from gdn_core.kcp.fold import fold_step
from gdn_core.kcp.summary import fragment_summary, state_dtype
from gdn_core.typed import (
    ModeTyped,
    TypedSaved,
    TypedWorkspace,
    input_versions,
    modified_input_error,
    require_instance,
)
from gdn_core.validation import GDNShapes, check_bool, check_input_values, validate_gdn_inputs

__all__ = [
    "EXCHANGES",
    "check_unmodified",
    "KCPGradsBase",
    "KCPSavedBase",
    "KCPWorkspaceBase",
    "kcp_backward",
    "check_forward_call",
    "check_forward_world",
    "kcp_backward_simulated",
    "kcp_forward",
    "kcp_forward_simulated",
]

EXCHANGES = ("allgather", "ring")


@dataclass(eq=False)
class KCPSavedBase(TypedSaved):
    """What a KCP backward needs from its forward (the packages type it per mode).

    Attributes:
        context: the rank's context; exchange: ``"allgather"`` or ``"ring"``.
        backend: the local kernels' backend; shapes: the shard's sizes.
        inner: the local :class:`~gdn_core.compose.GDNSaved` (``None`` for an
            empty rank).
        S_in: ``[HV,K,V]`` initial state of the first fragment (when it
            continues from an earlier rank).
        M: ``[HV,K,K]`` this rank's transition matrix (pass-through ranks).
        chain_M: ``[n,HV,K,K]``, the ``M`` of the pass-through ranks of the
            backward fold chain (``table.bwd_chain[:-1]``, in order), copied
            from the forward's all-gather (``"allgather"`` only; ``None`` when
            the chain has none).
        input_meta: ``(shape, dtype)`` of q, k, v, g, beta.
        input_versions: their version counters at the forward
            (:func:`gdn_core.typed.input_versions`), for the split API's in-place check.
    """

    context: KCPContext
    exchange: str
    backend: str
    shapes: GDNShapes
    inner: GDNSaved | None
    S_in: torch.Tensor | None
    M: torch.Tensor | None
    chain_M: torch.Tensor | None
    input_meta: tuple
    state_dtype: torch.dtype
    input_versions: tuple = ()

    @property
    def device(self) -> torch.device:
        """Where the forward's tensors live."""
        return self.inner.device if self.inner is not None else self.context.device


@dataclass(eq=False)
class KCPGradsBase(ModeTyped):
    """Gradients of one rank's shard: ``dq, dk: [1,T,H,K]``, ``dv: [1,T,HV,V]``,
    ``dg, dbeta: [1,T,HV]`` in the inputs' dtypes."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.dq, self.dk, self.dv, self.dg, self.dbeta


class KCPWorkspaceBase(TypedWorkspace):
    """Reusable buffers of a KCP backward: the exchange buffers
    (``gather [world,HV,K,V]``, ``carry [HV,K,V]``, in the state dtype;
    ``seg_gather [world,seg_slots,HV,K,V+K]`` for segment plans) and
    a cache of the local backward's workspace (triton backend; rebuilt when
    the shard's layout changes). Sized by ``world_size, HV, K, V``, state
    dtype and device, which must match the saved set exactly."""

    def __init__(self, world_size: int, HV: int, K: int, V: int, *,
                 device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(device, {}, {"world_size": world_size, "HV": HV, "K": K, "V": V,
                                      "state_dtype": dtype})
        self.gather = torch.empty(world_size, HV, K, V, dtype=dtype, device=self.device)
        self.carry = torch.empty(HV, K, V, dtype=dtype, device=self.device)
        self.inner: Any = None
        self.seg_gather: torch.Tensor | None = None  # segment plans, sized on first use

    @classmethod
    def for_saved(cls, saved: KCPSavedBase):
        """A workspace fitting ``saved`` (and every saved set of the same world and heads)."""
        s = saved.shapes
        return cls(saved.context.world_size, s.HV, s.K, s.V, device=saved.device,
                   dtype=saved.state_dtype)

    def check_saved(self, saved: KCPSavedBase, argname: str = "workspace") -> None:
        s = saved.shapes
        self.check_fits(saved.device, {}, {"world_size": saved.context.world_size, "HV": s.HV,
                                           "K": s.K, "V": s.V, "state_dtype": saved.state_dtype},
                        argname)


# ------------------------------------------------------------------ forward --


@dataclass
class _FwdArgs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    ctx: KCPContext
    shapes: GDNShapes
    scale: float | None
    l2: bool
    exchange: str
    backend: str
    deterministic: bool
    saved_cls: type


def _prepare_forward(q, k, v, g, beta, ctx, *, scale, use_qk_l2norm_in_kernel, exchange,
                     backend, deterministic, context_cls, saved_cls) -> _FwdArgs:
    """Every check of a KCP forward: runs before any communication."""
    ctx = require_instance(ctx, context_cls, "context")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != ctx.num_tokens:
        raise ValueError(
            f"q holds {q.shape[1]} tokens, but rank {ctx.rank}'s shard of the plan holds "
            f"{ctx.num_tokens} (tokens [{ctx.table.start}, {ctx.table.stop}) of the global "
            f"sequence)"
        )
    shapes = validate_gdn_inputs(q, k, v, g, beta, scale=scale,
                                 cu_seqlens=list(ctx.local_offsets), allow_float64=True)
    ctx.check_call(H=shapes.H, HV=shapes.HV, K=shapes.K, V=shapes.V, dtype=q.dtype,
                   exchange=exchange)  # what the build declared and every rank agreed on
    if q.device != ctx.device and not (q.device.type == ctx.device.type == "cuda"
                                       and ctx.device.index is None):
        raise ValueError(f"the inputs are on {q.device}, but the context was built for "
                         f"{ctx.device}")
    chosen = resolve_backend(q.device, q.dtype, backend)
    return _FwdArgs(q, k, v, g, beta, ctx, shapes, scale, bool(use_qk_l2norm_in_kernel),
                    exchange, chosen, deterministic, saved_cls)


def _segment_forward_steps(a: _FwdArgs):
    """The forward of a ``"segment"`` plan (module docstring)."""
    from gdn_core.segment import segment_fwd_begin, segment_fwd_finish, segment_fwd_fold

    ctx, tab, s = a.ctx, a.ctx.table, a.shapes
    HV, K, V = s.HV, s.K, s.V
    sd = state_dtype(a.q.dtype)
    dev = a.q.device
    W = ctx.world_size
    st = None
    if not tab.empty:
        scale = float(K**-0.5 if a.scale is None else a.scale)
        st = segment_fwd_begin(
            a.q, a.k, a.v, a.g, a.beta, layout=ctx.segments, scale=scale,
            use_qk_l2norm_in_kernel=a.l2, initial_state=None, backend=a.backend,
            deterministic=a.deterministic, shapes=s,
            index=ctx.seg_index if a.backend == "triton" else None,
        )
    if W == 1:
        if st is not None:
            segment_fwd_fold(st)
    elif a.exchange == "allgather":
        cap = ctx.seg_slots
        slot = torch.zeros(cap, HV, K, V + K, dtype=sd, device=dev)
        if tab.last_continues:
            L = ctx.segments
            lo, hi = L.doc_segs[-2], L.doc_segs[-1]
            slot[: hi - lo].copy_(st.export_rows(lo, hi))
        gathered = yield AllGather(slot)
        if st is not None:
            remote = None
            if tab.first_continues:
                rows = seg_exchange_rows(ctx, dev)[0]
                remote = gathered.reshape(W * cap, HV, K, V + K)[rows]
            segment_fwd_fold(st, remote=remote)
    else:
        done = []

        def step(carry_in: torch.Tensor) -> torch.Tensor:
            if tab.empty:
                return carry_in
            if not tab.last_continues:
                return torch.zeros_like(carry_in)
            out = segment_fwd_fold(st, seed=carry_in if tab.first_continues else None,
                                   want_exit=True)
            done.append(True)
            return out

        carry = yield RingPass(torch.zeros(HV, K, V, dtype=sd, device=dev), step)
        if st is not None and not done:
            segment_fwd_fold(st, seed=carry if tab.first_continues else None)
    inner = None
    if st is None:
        o = a.v.new_empty(1, 0, HV, V)
    else:
        o, _, inner = segment_fwd_finish(st)
    meta = tuple((tuple(x.shape), x.dtype) for x in (a.q, a.k, a.v, a.g, a.beta))
    saved = a.saved_cls(
        context=ctx, exchange=a.exchange, backend=a.backend, shapes=s, inner=inner,
        S_in=None, M=None, chain_M=None, input_meta=meta, state_dtype=sd,
        input_versions=_versions(a),
    )
    return o, saved


def _forward_steps(a: _FwdArgs):
    if a.ctx.plan.boundary == "segment":
        return (yield from _segment_forward_steps(a))
    ctx, tab, s = a.ctx, a.ctx.table, a.shapes
    HV, K, V = s.HV, s.K, s.V
    sd = state_dtype(a.q.dtype)
    dev = a.q.device

    # 1. summary of the last fragment
    M = E = None
    if tab.last_continues:
        M, E = fragment_summary(
            a.k, a.v, a.g, a.beta, tab.last_start, tab.num_tokens, need_M=tab.passthrough,
            backend=a.backend, use_qk_l2norm_in_kernel=a.l2,
            index=ctx.last_index if a.backend == "triton" else None,
        )

    # 2. exchange and fold
    chain_M = None
    S_in = None
    if a.exchange == "allgather":
        slot = torch.zeros(HV, K, K + V, dtype=sd, device=dev)
        if M is not None:
            slot[..., :K].copy_(M)
        else:
            slot[..., :K].copy_(torch.eye(K, dtype=sd, device=dev).expand(HV, K, K))
        if E is not None:
            slot[..., K:].copy_(E)
        gathered = yield AllGather(slot)
        if tab.first_continues:
            chain = tab.fwd_chain
            S = gathered[chain[0], :, :, K:]
            for j in chain[1:]:
                S = fold_step(gathered[j, :, :, :K], S, gathered[j, :, :, K:])
            S_in = S.contiguous()
        if len(tab.bwd_chain) > 1:  # keep only what the backward fold reads
            chain_M = torch.stack([gathered[j, :, :, :K] for j in tab.bwd_chain[:-1]])
    else:
        def step(carry_in: torch.Tensor) -> torch.Tensor:
            if tab.empty:
                return carry_in
            if not tab.last_continues:
                return torch.zeros_like(carry_in)
            if tab.passthrough:
                return fold_step(M, carry_in, E)
            return E

        carry = yield RingPass(torch.zeros(HV, K, V, dtype=sd, device=dev), step)
        if tab.first_continues:
            S_in = carry

    # 3. local forward
    inner = None
    if tab.empty:
        o = a.v.new_empty(1, 0, HV, V)
    else:
        h0 = None
        if tab.first_continues:
            h0 = torch.zeros(tab.num_fragments, HV, K, V, dtype=sd, device=dev)
            h0[0].copy_(S_in)
        o, _, inner = chunk_gdn_fwd(
            a.q, a.k, a.v, a.g, a.beta, scale=a.scale, initial_state=h0,
            cu_seqlens=list(tab.local_offsets), use_qk_l2norm_in_kernel=a.l2,
            deterministic=a.deterministic, backend=a.backend,
            index=ctx.index if a.backend == "triton" else None,
        )
    meta = tuple((tuple(x.shape), x.dtype) for x in (a.q, a.k, a.v, a.g, a.beta))
    saved = a.saved_cls(
        context=ctx, exchange=a.exchange, backend=a.backend, shapes=s, inner=inner,
        S_in=S_in, M=M if a.exchange == "ring" else None,
        chain_M=chain_M,
        input_meta=meta, state_dtype=sd, input_versions=_versions(a),
    )
    return o, saved


def _versions(a: _FwdArgs) -> tuple:
    return input_versions(dict(q=a.q, k=a.k, v=a.v, g=a.g, beta=a.beta))


def _values_error(a: _FwdArgs) -> str | None:
    """``check_inputs=True``: the message of this rank's first value outside the domain."""
    return check_input_values(a.g, a.beta)


def _agree_on_call(a: _FwdArgs, local_error: str | None, force: bool) -> None:
    """The ranks of a process group agree on this call (:mod:`gdn_core.kcp.agree`): one
    small all-gather at the first call of a signature (``force``: every call, with this
    rank's ``check_inputs`` outcome). Raises this rank's own error, or the
    ``ValueError`` every rank raises; before any exchange of the call."""
    ctx, s = a.ctx, a.shapes
    if ctx.simulated or ctx.group is None or ctx.world_size == 1:
        if local_error is not None:
            raise ValueError(local_error)
        return
    sig = call_signature(H=s.H, HV=s.HV, K=s.K, V=s.V, dtype=a.q.dtype, exchange=a.exchange,
                         l2=a.l2)
    if not force and sig in ctx.agreed_calls:
        return
    from gdn_core.kcp.context import _comm_device

    records = exchange_records(make_call_record(sig, local_error is not None), ctx.group,
                               _comm_device(ctx.group))
    if local_error is not None:
        raise ValueError(local_error)
    message = call_agreement_error(records)
    if message is not None:
        raise ValueError(message)
    ctx.agreed_calls.add(sig)


def check_forward_call(q, k, v, g, beta, context, *, deterministic: bool, context_cls: type,
                       saved_cls: type, scale=None, use_qk_l2norm_in_kernel=False,
                       exchange="allgather", backend=None, check_inputs=False) -> _FwdArgs:
    """Every check of one rank's KCP forward, before any exchange: the arguments, the
    ranks' agreement on the call (a collective at a new signature, or every call with
    ``check_inputs``), and with ``check_inputs=True`` the values of ``g`` and ``beta``
    (:func:`gdn_core.validation.check_input_values`: one host synchronisation; a bad
    value on any rank raises on every rank)."""
    a = _prepare_forward(q, k, v, g, beta, context, scale=scale,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
                         backend=backend, deterministic=deterministic,
                         context_cls=context_cls, saved_cls=saved_cls)
    force = check_bool("check_inputs", check_inputs)
    _agree_on_call(a, _values_error(a) if force else None, force)
    return a


def kcp_forward(q, k, v, g, beta, context, *, deterministic: bool, context_cls: type,
                saved_cls: type, scale=None, use_qk_l2norm_in_kernel=False,
                exchange="allgather", backend=None, check_inputs=False):
    """One rank's KCP forward over its context's process group → ``(o, saved)``."""
    a = check_forward_call(q, k, v, g, beta, context, deterministic=deterministic,
                           context_cls=context_cls, saved_cls=saved_cls, scale=scale,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
                           backend=backend, check_inputs=check_inputs)
    executor = a.ctx.executor()
    return drive(_forward_steps(a), executor)


def _check_world(contexts, context_cls) -> list:
    if not isinstance(contexts, (list, tuple)) or not contexts:
        raise ValueError("contexts must be a non-empty list of one context per rank")
    contexts = [require_instance(c, context_cls, f"contexts[{i}]")
                for i, c in enumerate(contexts)]
    plan = contexts[0].plan
    for r, c in enumerate(contexts):
        if c.plan.digest() != plan.digest() or c.rank != r or not c.simulated:
            raise ValueError(
                f"contexts[{r}] must be rank {r}'s simulated context of one plan "
                f"(got rank {c.rank}, simulated={c.simulated})"
            )
    if len(contexts) != plan.world_size:
        raise ValueError(f"the plan has {plan.world_size} ranks, got {len(contexts)} contexts")
    return contexts


def _per_rank(name: str, xs, n: int) -> list:
    if not isinstance(xs, (list, tuple)) or len(xs) != n:
        raise ValueError(f"{name} must be a list of {n} tensors (one per rank)")
    return list(xs)


def check_forward_world(qs, ks, vs, gs, betas, contexts, *, deterministic: bool,
                        context_cls: type, saved_cls: type, scale=None,
                        use_qk_l2norm_in_kernel=False, exchange="allgather", backend=None,
                        check_inputs=False) -> list[_FwdArgs]:
    """Every check of a simulated world's forward (every rank's, and with
    ``check_inputs=True`` their values: ``ValueError`` naming the rank)."""
    contexts = _check_world(contexts, context_cls)
    W = len(contexts)
    ins = [_per_rank(n, x, W) for n, x in
           (("qs", qs), ("ks", ks), ("vs", vs), ("gs", gs), ("betas", betas))]
    args = [
        _prepare_forward(*(x[r] for x in ins), contexts[r], scale=scale,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
                         backend=backend, deterministic=deterministic,
                         context_cls=context_cls, saved_cls=saved_cls)
        for r in range(W)
    ]
    if check_bool("check_inputs", check_inputs):
        for r, a in enumerate(args):
            err = _values_error(a)
            if err is not None:
                raise ValueError(f"rank {r}: {err}")
    return args


def kcp_forward_simulated(qs, ks, vs, gs, betas, contexts, *, deterministic: bool,
                          context_cls: type, saved_cls: type, scale=None,
                          use_qk_l2norm_in_kernel=False, exchange="allgather", backend=None,
                          check_inputs=False):
    """Every rank's KCP forward of a simulated world → ``([o], [saved])``."""
    args = check_forward_world(qs, ks, vs, gs, betas, contexts, deterministic=deterministic,
                               context_cls=context_cls, saved_cls=saved_cls, scale=scale,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               exchange=exchange, backend=backend, check_inputs=check_inputs)
    out = drive_simulated([_forward_steps(a) for a in args])
    return [o for o, _ in out], [s for _, s in out]


# ----------------------------------------------------------------- backward --


@dataclass
class _BwdArgs:
    saved: KCPSavedBase
    do: torch.Tensor
    workspace: KCPWorkspaceBase | None
    deterministic: bool
    grads_cls: type


def _prepare_backward(saved, do, workspace, *, deterministic, saved_cls, workspace_cls,
                      grads_cls) -> _BwdArgs:
    """Every check of a KCP backward: runs before any communication."""
    saved = require_instance(saved, saved_cls, "saved")
    if workspace is not None:
        workspace = require_instance(workspace, workspace_cls, "workspace")
        workspace.check_saved(saved)
    s = saved.shapes
    if not isinstance(do, torch.Tensor):
        raise TypeError(f"do must be a torch.Tensor, got {type(do).__name__}")
    want = (1, saved.context.num_tokens, s.HV, s.V)
    if tuple(do.shape) != want:
        raise ValueError(f"do must have shape {want} (this rank's output), got "
                         f"{tuple(do.shape)}")
    if do.device != saved.device:
        raise ValueError(f"do is on {do.device}, the forward ran on {saved.device}")
    return _BwdArgs(saved, do, workspace, deterministic, grads_cls)


def check_unmodified(saved, forward: str, *, agree: bool) -> None:
    """The split API's in-place check of one rank's saved set: ``ValueError`` when an
    input of ``forward`` was modified in place since. With ``agree`` and a process
    group of several ranks, the ranks first exchange their outcomes (one small
    all-gather; on NCCL a host synchronisation) and every rank raises; without it only
    the modified rank does."""
    message = modified_input_error(saved.input_versions, forward)
    ctx = saved.context
    if agree and not ctx.simulated and ctx.group is not None and ctx.world_size > 1:
        from gdn_core.kcp.context import _comm_device

        records = exchange_records(make_backward_record(message is not None), ctx.group,
                                   _comm_device(ctx.group))
        if message is None:
            message = backward_agreement_error(records)
    if message is not None:
        raise ValueError(message)


def _first_fragment_dh0(inner: GDNSaved, do: torch.Tensor, L1: int, S_in: torch.Tensor,
                        index, deterministic: bool) -> torch.Tensor:
    """Initial-state gradient of the first fragment alone, with a zero final-state gradient."""
    if inner.segments is not None:
        from gdn_core.segment import first_document_saved

        sub = first_document_saved(inner, L1)
        return chunk_gdn_bwd(sub, do[:, :L1], None, deterministic=deterministic).dh0[0]
    s = inner.shapes
    if inner.backend == "reference":
        def cut(x):
            return None if x is None else x[:, :L1]
    else:
        def cut(x):
            return None if x is None else x[:L1]
    sub = dataclasses.replace(
        inner,
        shapes=GDNShapes(B=1, T=L1, H=s.H, HV=s.HV, K=s.K, V=s.V, offsets=(0, L1)),
        q=cut(inner.q), k=cut(inner.k), v=cut(inner.v), g=cut(inner.g), beta=cut(inner.beta),
        G=cut(inner.G), q_rstd=cut(inner.q_rstd), k_rstd=cut(inner.k_rstd),
        initial_state=S_in[None], index=index if inner.backend == "triton" else None,
        A_inv=None,  # recomputed on the sub-problem's chunk table
    )
    grads = chunk_gdn_bwd(sub, do[:, :L1], None, deterministic=deterministic)
    return grads.dh0[0]


def _inner_workspace(ws: KCPWorkspaceBase | None, inner: GDNSaved, deterministic: bool):
    """The local backward's workspace (triton backend), cached in the KCP workspace."""
    if ws is None or inner.backend != "triton":
        return None
    from gdn_core.ops.backward import BackwardWorkspace

    s, idx = inner.shapes, inner.index
    want = dict(deterministic=deterministic, T=s.B * s.T, H=s.H, HV=s.HV, K=s.K, V=s.V,
                num_chunks=idx.num_chunks, num_docs=idx.num_docs, dtype=inner.v.dtype,
                device=inner.v.device)
    cur = ws.inner
    if cur is not None:
        try:
            cur.check(**want)
            return cur
        except ValueError:
            pass
    ws.inner = BackwardWorkspace.for_shapes(
        want["T"], s.H, s.HV, s.K, s.V, idx.num_chunks, idx.num_docs, inner.v.dtype,
        inner.v.device, deterministic=deterministic)
    return ws.inner


def _local_backward(a: _BwdArgs, dht_last: torch.Tensor | None):
    saved, tab = a.saved, a.saved.context.table
    inner = saved.inner
    dht = None
    if dht_last is not None:
        s = saved.shapes
        dht = torch.zeros(tab.num_fragments, s.HV, s.K, s.V, dtype=saved.state_dtype,
                          device=dht_last.device)
        dht[-1].copy_(dht_last)
    return chunk_gdn_bwd(inner, a.do, dht, deterministic=a.deterministic,
                         workspace=_inner_workspace(a.workspace, inner, a.deterministic))


def _seg_gather_buffer(ws: KCPWorkspaceBase | None, shape, dtype, device):
    """The workspace's segment all-gather buffer (made on first use, remade if
    the plan's slot count changes)."""
    if ws is None:
        return None
    buf = getattr(ws, "seg_gather", None)
    if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
        buf = torch.empty(shape, dtype=dtype, device=device)
        ws.seg_gather = buf
    return buf


def _segment_backward_steps(a: _BwdArgs):
    """The backward of a ``"segment"`` plan (module docstring)."""
    from gdn_core.segment import segment_bwd_begin, segment_bwd_finish, segment_bwd_fold

    saved = a.saved
    ctx = saved.context
    tab = ctx.table
    s = saved.shapes
    HV, K, V = s.HV, s.K, s.V
    sd = saved.state_dtype
    dev = a.do.device
    W = ctx.world_size
    bst = None
    if not tab.empty:
        bst = segment_bwd_begin(saved.inner, a.do, None, deterministic=a.deterministic,
                                workspace=_inner_workspace(a.workspace, saved.inner,
                                                           a.deterministic))
    if W == 1:
        if bst is not None:
            segment_bwd_fold(bst)
    elif saved.exchange == "allgather":
        cap = ctx.seg_slots
        slot = torch.zeros(cap, HV, K, V + K, dtype=sd, device=dev)
        if tab.first_continues:
            n0 = ctx.segments.doc_segs[1]
            slot[:n0].copy_(bst.export_rows(0, n0))
        buf = _seg_gather_buffer(a.workspace, (W, *slot.shape), sd, dev)
        got = yield AllGather(slot, buf)
        if bst is not None:
            remote = None
            if tab.last_continues:
                rows = seg_exchange_rows(ctx, dev)[1]
                remote = got.reshape(W * cap, HV, K, V + K)[rows]
            segment_bwd_fold(bst, remote=remote)
    else:
        done = []

        def step(carry_in: torch.Tensor) -> torch.Tensor:
            if tab.empty:
                return carry_in
            if not tab.first_continues:
                return torch.zeros_like(carry_in)
            out = segment_bwd_fold(bst, seed=carry_in if tab.last_continues else None,
                                   want_first=True)
            done.append(True)
            return out

        ws = a.workspace
        carry = ws.carry.zero_() if ws is not None else torch.zeros(HV, K, V, dtype=sd,
                                                                      device=dev)
        carry = yield RingPass(carry, step, reverse=True)
        if bst is not None and not done:
            segment_bwd_fold(bst, seed=carry if tab.last_continues else None)
    if bst is None:
        zeros = [torch.zeros(shape, dtype=dt, device=dev) for shape, dt in saved.input_meta]
        return a.grads_cls(*zeros)
    g = segment_bwd_finish(bst)
    return a.grads_cls(g.dq, g.dk, g.dv, g.dg, g.dbeta)


def _backward_steps(a: _BwdArgs):
    if a.saved.context.plan.boundary == "segment":
        return (yield from _segment_backward_steps(a))
    saved = a.saved
    tab = saved.context.table
    s = saved.shapes
    HV, K, V = s.HV, s.K, s.V
    sd = saved.state_dtype
    dev = a.do.device
    ws = a.workspace

    # 1. dS_loc of the first fragment
    local: GDNGrads | None = None
    d_loc = None
    if tab.first_continues:
        if not tab.last_continues:
            local = _local_backward(a, None)
            d_loc = local.dh0[0]
        else:
            d_loc = _first_fragment_dh0(saved.inner, a.do, tab.first_length, saved.S_in,
                                        saved.context.first_index, a.deterministic)

    # 2. exchange and fold from later ranks
    D = None
    if saved.exchange == "allgather":
        slot = torch.zeros(HV, K, V, dtype=sd, device=dev) if d_loc is None else d_loc
        got = yield AllGather(slot.to(sd).contiguous(), ws.gather if ws is not None else None)
        if tab.last_continues:
            chain = tab.bwd_chain
            X = got[chain[-1]]
            for i in reversed(range(len(chain) - 1)):
                X = fold_step(saved.chain_M[i], X, got[chain[i]], transpose=True)
            D = X
    else:
        def step(carry_in: torch.Tensor) -> torch.Tensor:
            if tab.empty:
                return carry_in
            if not tab.first_continues:
                return torch.zeros_like(carry_in)
            if tab.passthrough:
                return fold_step(saved.M, carry_in, d_loc.to(sd), transpose=True)
            return d_loc.to(sd)

        carry = ws.carry.zero_() if ws is not None else torch.zeros(HV, K, V, dtype=sd,
                                                                      device=dev)
        got = yield RingPass(carry, step, reverse=True)
        if tab.last_continues:
            D = got

    # 3. local backward
    if tab.empty:
        zeros = [torch.zeros(shape, dtype=dt, device=dev) for shape, dt in saved.input_meta]
        return a.grads_cls(*zeros)
    if local is None:
        local = _local_backward(a, D)
    return a.grads_cls(local.dq, local.dk, local.dv, local.dg, local.dbeta)


def kcp_backward(saved, do, workspace=None, *, deterministic: bool, saved_cls: type,
                 workspace_cls: type, grads_cls: type,
                 unmodified: tuple[str, bool] | None = None):
    """One rank's KCP backward over its context's process group → ``grads_cls``.

    ``unmodified``: ``(the forward's name, agree)`` — the split API's in-place check
    (:func:`check_unmodified`); ``None`` where autograd checks the inputs itself."""
    a = _prepare_backward(saved, do, workspace, deterministic=deterministic,
                          saved_cls=saved_cls, workspace_cls=workspace_cls,
                          grads_cls=grads_cls)
    if unmodified is not None:
        check_unmodified(a.saved, unmodified[0], agree=unmodified[1])
    return drive(_backward_steps(a), a.saved.context.executor())


def kcp_backward_simulated(saveds, dos, workspaces=None, *, deterministic: bool,
                           saved_cls: type, workspace_cls: type, grads_cls: type,
                           unmodified: str | None = None):
    """Every rank's KCP backward of a simulated world → ``[grads]`` (``unmodified``: the
    forward's name, for the split API's in-place check of every rank's saved set)."""
    if not isinstance(saveds, (list, tuple)) or not saveds:
        raise ValueError("saveds must be a non-empty list of one saved set per rank")
    W = len(saveds)
    dos = _per_rank("dos", dos, W)
    if workspaces is None:
        workspaces = [None] * W
    workspaces = _per_rank("workspaces", workspaces, W)
    args = [_prepare_backward(saveds[r], dos[r], workspaces[r], deterministic=deterministic,
                              saved_cls=saved_cls, workspace_cls=workspace_cls,
                              grads_cls=grads_cls) for r in range(W)]
    _check_world([a.saved.context for a in args], type(args[0].saved.context))
    if unmodified is not None:
        for a in args:
            check_unmodified(a.saved, unmodified, agree=False)
    return drive_simulated([_backward_steps(a) for a in args])
