"""Custom ops of the context-parallel (KCP) training packages.

:func:`define_kcp_ops` registers, in a package's namespace ``ns`` (each with a
fake implementation and its backward op registered as autograd):

* ``ns::kcp_chunk_gated_delta_rule`` → ``(o, token)`` — one rank's KCP GDN
  (:func:`gdn_core.kcp.compose.kcp_forward` / ``kcp_backward``);
* ``ns::kcp_chunk_gated_delta_rule_simulated`` → ``(o[], token)`` — every
  rank of a simulated world;
* ``ns::kcp_causal_conv1d`` → ``(y, token)`` and
  ``ns::kcp_causal_conv1d_simulated`` → ``(y[], token)`` — the conv with its
  halo exchange;

and the ``…_bwd`` op of each. A context reaches an op through its handle
(:func:`gdn_core.custom_ops.object_handle`: a CPU scalar tensor), so under
``torch.compile`` a new plan's context of the same package does not
recompile: the graph's inputs are the shard tensors and the handle. The
context carries every host table the rank needs (docs/context-parallel.md), so neither
forward nor backward reads a device tensor on the host. Collectives run
inside the ops; every rank must run the compiled step, as the eager one.

Eagerly, one rank's GDN call skips the op: :class:`_KCPGDNFunction` runs the same
forward and backward bodies (:meth:`KCPOps._gdn_forward`, :meth:`KCPOps._gdn_backward`)
and its node holds what the backward reads (the op's Python dispatch costs host time;
the bits are the same). Through the op, the forward's saved set rides in the stash of
:mod:`gdn_core.custom_ops` under the returned token; the shard tensors it refers to
are passed to the backward op again (saved by AOTAutograd) and put back in place.

**Static world-1 contexts** (CUDA graphs). :func:`attach_static_layout` gives
a world-of-one context a :class:`gdn_core.layout.VarlenLayout` with fixed
capacities; the ops then run the local kernels over the layout's fixed-size
device tables (the computation of the KCP path at one rank, which is the
single-rank one: same bits — without segments, ``segment_size=0``, so for
documents longer than a segment those of ``segment_size=0``), so a captured
training step replays for the next batch after :func:`rebind_static_context`
copied the new plan's layout into the same buffers. (Worlds of several
ranks keep the per-plan control flow of :mod:`gdn_core.kcp.compose`: their
exchanged tensors already have plan-independent shapes, but which ranks fold
and which fragments continue still follows the plan; capturing them needs
that made data-driven too.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gdn_core.compose import GDNSaved, chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.conv1d import causal_conv1d_bwd, causal_conv1d_fwd, validate_conv1d_inputs
from gdn_core.custom_ops import (
    autograd_enabled,
    define_op,
    is_compiling,
    lookup,
    object_handle,
    register_handle,
    stash_get,
    stash_put,
)
from gdn_core.kcp.compose import (
    EXCHANGES,
    kcp_backward,
    kcp_backward_simulated,
    kcp_forward,
    kcp_forward_simulated,
)
from gdn_core.kcp.conv import (
    kcp_conv_backward,
    kcp_conv_backward_simulated,
    kcp_conv_forward,
    kcp_conv_forward_simulated,
)
from gdn_core.layout import VarlenLayout
from gdn_core.saved import graph_is_released
from gdn_core.typed import require_instance

__all__ = [
    "KCPOps",
    "attach_static_layout",
    "define_kcp_ops",
    "rebind_static_context",
    "static_layout",
]

Tensor = torch.Tensor
_LAYOUT_ATTR = "_gdn_static_layout"


def _token_fake() -> Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


def _like(t: Tensor) -> Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# ----------------------------------------------------- static contexts --


def static_layout(context: Any) -> VarlenLayout | None:
    """The static layout of a context (``None`` for an ordinary one)."""
    return getattr(context, _LAYOUT_ATTR, None)


def attach_static_layout(context: Any, *, max_docs: int, max_chunks: int | None = None
                         ) -> VarlenLayout:
    """Make a world-of-one context *static*: the ops run over a
    :class:`~gdn_core.layout.VarlenLayout` of its shard with capacities
    ``max_docs`` (fragments) and ``max_chunks``, whose device tables keep their
    shapes and addresses across :func:`rebind_static_context`."""
    if context.world_size != 1:
        raise ValueError(
            f"static (CUDA-graph) contexts need world_size == 1, got {context.world_size}; "
            "use the simulated world or a process group without capture"
        )
    if context.simulated:
        raise ValueError("a static context cannot belong to a simulated world")
    lay = VarlenLayout(list(context.local_offsets), device=context.device, max_docs=max_docs,
                       max_chunks=max_chunks, chunk_size=context.plan.chunk_size)
    object.__setattr__(context, _LAYOUT_ATTR, lay)
    register_handle(context)
    return lay


def rebind_static_context(context: Any, plan: Any, *, plan_cls: type, context_cls: type) -> Any:
    """Point a static context at ``plan`` (same world of one, same token count) in
    place: its layout's device buffers get the new tables (outside a capture),
    its host tables are rebuilt. Returns ``context``."""
    from gdn_core.kcp.context import build_context

    context = require_instance(context, context_cls, "context")
    plan = require_instance(plan, plan_cls, "plan")
    lay = static_layout(context)
    if lay is None:
        raise ValueError("context is not static (build it with max_docs=...)")
    if plan.world_size != 1:
        raise ValueError(f"a static context serves world_size == 1 plans, got {plan.world_size}")
    fresh = build_context(plan, 0, device=context.device, plan_cls=plan_cls,
                          context_cls=context_cls)
    offs = list(fresh.local_offsets)
    lay.update(offs)  # validates T and the capacities first
    for f in dataclasses.fields(context):
        setattr(context, f.name, getattr(fresh, f.name))
    return context


def _check_static(ctx, x: Tensor, lay: VarlenLayout) -> None:
    if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != lay.total_tokens:
        raise ValueError(f"the inputs hold {tuple(x.shape[:2])} tokens, but the static context "
                         f"holds [1, {lay.total_tokens}]")
    if x.device != ctx.device and not (x.device.type == ctx.device.type == "cuda"
                                       and ctx.device.index is None):
        raise ValueError(f"the inputs are on {x.device}, the context on {ctx.device}")


# --------------------------------------------------------------- entries --


@dataclass
class _GDNEntry:
    saved: Any              # the package's KCP saved set (ordinary contexts)
    core: GDNSaved | None   # the local saved set (static contexts)
    workspace: Any


@dataclass
class _ConvEntry:
    saved: Any              # ConvSaved (ordinary contexts) or a list of them (simulated)
    static: tuple | None    # (x-free) static data: (doc_pos, activation)


class KCPOps:
    """The KCP ops of one namespace and the calls routing a package's API to them."""

    def __init__(self, namespace: str, *, deterministic: bool, context_cls: type,
                 saved_cls: type, workspace_cls: type, grads_cls: type) -> None:
        self.namespace = namespace
        self.deterministic = deterministic
        self.context_cls = context_cls
        self.types = dict(saved_cls=saved_cls, workspace_cls=workspace_cls, grads_cls=grads_cls)
        self.workspace_cls = workspace_cls
        self._define_gdn()
        self._define_gdn_simulated()
        self._define_conv()
        self._define_conv_simulated()

    # ------------------------------------------------------------- GDN --

    def _gdn_forward(self, q, k, v, g, beta, ctx, ws, scale, use_qk_l2norm_in_kernel, exchange,
                     backend) -> tuple[Tensor, _GDNEntry]:
        """One rank's forward (``ctx``, ``ws``: the context and workspace objects) →
        ``(o, what its backward reads)``: the body of the op and of the eager call."""
        det, types = self.deterministic, self.types
        lay = static_layout(ctx)
        if lay is not None:
            if exchange not in EXCHANGES:
                raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
            _check_static(ctx, q, lay)
            o, _, core = chunk_gdn_fwd(
                q, k, v, g, beta, scale=scale, cu_seqlens=list(lay.padded_offsets),
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, deterministic=det,
                backend=backend, index=lay.index, segment_size=0,
            )
            return o, _GDNEntry(None, core, ws)
        o, saved = kcp_forward(
            q, k, v, g, beta, ctx, deterministic=det, context_cls=self.context_cls,
            saved_cls=types["saved_cls"], scale=scale,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
            backend=backend,
        )
        return o, _GDNEntry(saved, None, ws)

    def _gdn_backward(self, e: _GDNEntry, do: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(dq, dk, dv, dg, dbeta)`` of a :meth:`_gdn_forward` (collectives included)."""
        det = self.deterministic
        with autograd_enabled():
            if e.core is not None:
                gr = chunk_gdn_bwd(e.core, do.contiguous(), None, deterministic=det)
                return gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta
            grads = kcp_backward(e.saved, do.contiguous(), e.workspace, deterministic=det,
                                 **self.types)
        return grads.as_tuple()

    def _define_gdn(self) -> None:
        ctx_cls = self.context_cls

        def fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, context: Tensor,
                workspace: Tensor | None, scale: float | None, use_qk_l2norm_in_kernel: bool,
                exchange: str, backend: str | None) -> tuple[Tensor, Tensor]:
            ctx = require_instance(lookup(context, "context"), ctx_cls, "context")
            ws = lookup(workspace, "workspace") if workspace is not None else None
            o, entry = self._gdn_forward(q, k, v, g, beta, ctx, ws, scale,
                                         use_qk_l2norm_in_kernel, exchange, backend)
            return o, stash_put(entry, args=(q, k, v, g, beta), outs=(o,))

        def fwd_fake(q, k, v, g, beta, context, workspace, scale, use_qk_l2norm_in_kernel,
                     exchange, backend):
            return _like(v), _token_fake()

        def bwd(do: Tensor, token: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                beta: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
            return self._gdn_backward(stash_get(token, (q, k, v, g, beta)), do)

        def bwd_fake(do, token, q, k, v, g, beta):
            return _like(q), _like(k), _like(v), _like(g), _like(beta)

        bwd_op = define_op(self.namespace, "kcp_chunk_gated_delta_rule_bwd", bwd,
                           fake=bwd_fake)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output[1], *inputs[:5])

        def backward(ctx, do, _dtoken):
            token, *ins = ctx.saved_tensors
            if do is None:
                do = torch.zeros_like(ins[2])
            return (*bwd_op(do, token, *ins), None, None, None, None, None, None)

        self.gdn_bwd = bwd_op
        self.gdn = define_op(self.namespace, "kcp_chunk_gated_delta_rule", fwd, fake=fwd_fake,
                             backward=backward, setup_context=setup_context)

    def _define_gdn_simulated(self) -> None:
        det, ctx_cls, types = self.deterministic, self.context_cls, self.types

        def fwd(qs: list[Tensor], ks: list[Tensor], vs: list[Tensor], gs: list[Tensor],
                betas: list[Tensor], contexts: list[Tensor], scale: float | None,
                use_qk_l2norm_in_kernel: bool, exchange: str, backend: str | None,
                ) -> tuple[list[Tensor], Tensor]:
            ctxs = [lookup(c, "contexts") for c in contexts]
            os_, saveds = kcp_forward_simulated(
                qs, ks, vs, gs, betas, ctxs, deterministic=det, context_cls=ctx_cls,
                saved_cls=types["saved_cls"], scale=scale,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
                backend=backend,
            )
            flat = [*qs, *ks, *vs, *gs, *betas]
            return os_, stash_put(saveds, args=flat, outs=os_)

        def fwd_fake(qs, ks, vs, gs, betas, contexts, scale, use_qk_l2norm_in_kernel, exchange,
                     backend):
            return [_like(v) for v in vs], _token_fake()

        def bwd(dos: list[Tensor], token: Tensor, qs: list[Tensor], ks: list[Tensor],
                vs: list[Tensor], gs: list[Tensor], betas: list[Tensor]) -> list[Tensor]:
            saveds = stash_get(token, [*qs, *ks, *vs, *gs, *betas])
            with autograd_enabled():
                grads = kcp_backward_simulated(saveds, [d.contiguous() for d in dos], None,
                                               deterministic=det, **types)
            return [getattr(gr, n) for n in ("dq", "dk", "dv", "dg", "dbeta") for gr in grads]

        def bwd_fake(dos, token, qs, ks, vs, gs, betas):
            return [_like(x) for xs in (qs, ks, vs, gs, betas) for x in xs]

        bwd_op = define_op(self.namespace, "kcp_chunk_gated_delta_rule_simulated_bwd", bwd,
                           fake=bwd_fake)

        def setup_context(ctx, inputs, output):
            qs, ks, vs, gs, betas = inputs[:5]
            ctx.W = len(qs)
            ctx.save_for_backward(output[1], *qs, *ks, *vs, *gs, *betas)

        def backward(ctx, dos, _dtoken):
            token, *flat = ctx.saved_tensors
            W = ctx.W
            lists = [flat[i * W:(i + 1) * W] for i in range(5)]
            dos = [d if d is not None else torch.zeros_like(v) for d, v in zip(dos, lists[2])]
            grads = bwd_op(list(dos), token, *lists)
            per = [list(grads[i * W:(i + 1) * W]) for i in range(5)]
            return (*per, [None] * W, None, None, None, None)

        self.gdn_simulated_bwd = bwd_op
        self.gdn_simulated = define_op(
            self.namespace, "kcp_chunk_gated_delta_rule_simulated", fwd, fake=fwd_fake,
            backward=backward, setup_context=setup_context)

    # ------------------------------------------------------------ conv --

    def _define_conv(self) -> None:
        det, ctx_cls = self.deterministic, self.context_cls

        def fwd(x: Tensor, weight: Tensor, bias: Tensor | None, context: Tensor,
                activation: str | None) -> tuple[Tensor, Tensor]:
            ctx = require_instance(lookup(context, "context"), ctx_cls, "context")
            lay = static_layout(ctx)
            if lay is not None:
                validate_conv1d_inputs(x, weight, bias, activation)
                _check_static(ctx, x, lay)
                y = causal_conv1d_fwd(x, weight, bias, activation, deterministic=det,
                                      doc_pos=lay.doc_pos)
                entry = _ConvEntry(None, (lay, activation))
            else:
                y, saved = kcp_conv_forward(x, weight, bias, ctx, activation=activation,
                                            deterministic=det, context_cls=ctx_cls)
                entry = _ConvEntry(saved, None)
            return y, stash_put(entry, args=(x, weight, bias), outs=(y,))

        def fwd_fake(x, weight, bias, context, activation):
            return _like(x), _token_fake()

        def bwd(dy: Tensor, token: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor]:
            e = stash_get(token, (x, weight, bias))
            if e.static is not None:
                lay, activation = e.static
                dx, dw, db, _ = causal_conv1d_bwd(x, weight, bias, dy.contiguous(), activation,
                                                  deterministic=det, doc_pos=lay.doc_pos)
                # the KCP path adds the (zero) halo gradient of the next rank to the last
                # W-1 tokens; do the same so that even the signs of zeros agree
                n = min(weight.shape[1] - 1, x.shape[1])
                if n:
                    dx = dx.clone()
                    dx[0, x.shape[1] - n:] += torch.zeros_like(dx[0, x.shape[1] - n:])
            else:
                dx, dw, db = kcp_conv_backward(e.saved, dy.contiguous())
            return dx, dw, db if db is not None else dy.new_empty(0)

        def bwd_fake(dy, token, x, weight, bias):
            return _like(x), _like(weight), _like(bias) if bias is not None else dy.new_empty(0)

        bwd_op = define_op(self.namespace, "kcp_causal_conv1d_bwd", bwd, fake=bwd_fake)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output[1], *inputs[:3])

        def backward(ctx, dy, _dtoken):
            token, x, weight, bias = ctx.saved_tensors
            dx, dw, db = bwd_op(dy, token, x, weight, bias)
            return dx, dw, (db if bias is not None else None), None, None

        self.conv_bwd = bwd_op
        self.conv = define_op(self.namespace, "kcp_causal_conv1d", fwd, fake=fwd_fake,
                              backward=backward, setup_context=setup_context)

    def _define_conv_simulated(self) -> None:
        det, ctx_cls = self.deterministic, self.context_cls

        def fwd(xs: list[Tensor], weight: Tensor, bias: Tensor | None, contexts: list[Tensor],
                activation: str | None) -> tuple[list[Tensor], Tensor]:
            ctxs = [lookup(c, "contexts") for c in contexts]
            ys, saveds = kcp_conv_forward_simulated(list(xs), weight, bias, ctxs,
                                                    activation=activation, deterministic=det,
                                                    context_cls=ctx_cls)
            return ys, stash_put(saveds, args=[*xs, weight, bias], outs=ys)

        def fwd_fake(xs, weight, bias, contexts, activation):
            return [_like(x) for x in xs], _token_fake()

        def bwd(dys: list[Tensor], token: Tensor, xs: list[Tensor], weight: Tensor,
                bias: Tensor | None) -> tuple[list[Tensor], Tensor, Tensor]:
            saveds = stash_get(token, [*xs, weight, bias])
            out = kcp_conv_backward_simulated(saveds, [d.contiguous() for d in dys])
            dw = out[0][1]
            for _, w, _ in out[1:]:  # rank order
                dw = dw + w
            db = dys[0].new_empty(0)
            if bias is not None:
                db = out[0][2]
                for _, _, b in out[1:]:
                    db = db + b
            return [dx for dx, _, _ in out], dw, db

        def bwd_fake(dys, token, xs, weight, bias):
            return ([_like(x) for x in xs], _like(weight),
                    _like(bias) if bias is not None else dys[0].new_empty(0))

        bwd_op = define_op(self.namespace, "kcp_causal_conv1d_simulated_bwd", bwd,
                           fake=bwd_fake)

        def setup_context(ctx, inputs, output):
            xs, weight, bias = inputs[:3]
            ctx.W = len(xs)
            ctx.save_for_backward(output[1], weight, bias, *xs)

        def backward(ctx, dys, _dtoken):
            token, weight, bias, *xs = ctx.saved_tensors
            dys = [d if d is not None else torch.zeros_like(x) for d, x in zip(dys, xs)]
            dxs, dw, db = bwd_op(list(dys), token, list(xs), weight, bias)
            return list(dxs), dw, (db if bias is not None else None), [None] * ctx.W, None

        self.conv_simulated_bwd = bwd_op
        self.conv_simulated = define_op(
            self.namespace, "kcp_causal_conv1d_simulated", fwd, fake=fwd_fake,
            backward=backward, setup_context=setup_context)

    # ------------------------------------------------------ public calls --

    def _context_handle(self, context: Any, argname: str = "context") -> Tensor:
        if not is_compiling():
            require_instance(context, self.context_cls, argname)
        return object_handle(context, argname)

    def _workspace_handle(self, workspace: Any) -> Tensor | None:
        if workspace is None:
            return None
        if not is_compiling():
            require_instance(workspace, self.workspace_cls, "workspace")
        return object_handle(workspace, "workspace")

    def chunk_gated_delta_rule(self, q, k, v, g, beta, context, *, scale=None,
                               use_qk_l2norm_in_kernel=False, exchange="allgather",
                               backend=None, workspace=None) -> Tensor:
        """One rank's differentiable KCP GDN → ``o``: eagerly through
        :class:`_KCPGDNFunction` (the op's Python dispatch costs host time; the same
        bits), under ``torch.compile`` through the op."""
        if not is_compiling():
            require_instance(context, self.context_cls, "context")
            if workspace is not None:
                require_instance(workspace, self.workspace_cls, "workspace")
            return _KCPGDNFunction.apply(
                self, context, workspace, None if scale is None else float(scale),
                bool(use_qk_l2norm_in_kernel), exchange, backend, q, k, v, g, beta)
        h = self._context_handle(context)
        ws = self._workspace_handle(workspace)
        o, _ = self.gdn(q, k, v, g, beta, h, ws, None if scale is None else float(scale),
                        bool(use_qk_l2norm_in_kernel), exchange, backend)
        return o

    def chunk_gated_delta_rule_simulated(self, qs, ks, vs, gs, betas, contexts, *, scale=None,
                                         use_qk_l2norm_in_kernel=False, exchange="allgather",
                                         backend=None) -> list[Tensor]:
        """Every rank of a simulated world, differentiable, through the ops → ``[o]``."""
        W = self._world(contexts)
        lists = [_list(xs, W, name) for xs, name in
                 ((qs, "qs"), (ks, "ks"), (vs, "vs"), (gs, "gs"), (betas, "betas"))]
        hs = [self._context_handle(c, f"contexts[{i}]") for i, c in enumerate(contexts)]
        os_, _ = self.gdn_simulated(*lists, hs, None if scale is None else float(scale),
                                    bool(use_qk_l2norm_in_kernel), exchange, backend)
        return list(os_)

    def causal_conv1d(self, x, weight, bias, context, activation="silu") -> Tensor:
        """One rank's differentiable conv with the halo exchange through the ops → ``y``."""
        y, _ = self.conv(x, weight, bias, self._context_handle(context), activation)
        return y

    def causal_conv1d_simulated(self, xs, weight, bias, contexts, activation="silu"
                                ) -> list[Tensor]:
        """Every rank's conv of a simulated world through the ops → ``[y]``."""
        W = self._world(contexts)
        xs = _list(xs, W, "xs")
        hs = [self._context_handle(c, f"contexts[{i}]") for i, c in enumerate(contexts)]
        ys, _ = self.conv_simulated(xs, weight, bias, hs, activation)
        return list(ys)

    @staticmethod
    def _world(contexts) -> int:
        if not isinstance(contexts, (list, tuple)) or not contexts:
            raise ValueError("contexts must be a non-empty list of one context per rank")
        return len(contexts)


class _KCPGDNFunction(torch.autograd.Function):
    """The eager form of ``ns::kcp_chunk_gated_delta_rule``: the same forward and
    backward bodies (:meth:`KCPOps._gdn_forward`, :meth:`KCPOps._gdn_backward`), what the
    backward reads held by the node instead of the stash, and dropped by a backward that
    frees the graph (:func:`gdn_core.saved.graph_is_released`); the shards are saved for
    autograd's in-place check."""

    @staticmethod
    def forward(ctx, ops, context, workspace, scale, l2, exchange, backend, q, k, v, g, beta):
        o, entry = ops._gdn_forward(q, k, v, g, beta, context, workspace, scale, l2, exchange,
                                    backend)
        ctx.save_for_backward(q, k, v, g, beta)
        ctx.ops, ctx.entry = ops, entry
        return o

    @staticmethod
    def backward(ctx, do):
        ctx.saved_tensors  # noqa: B018 -- autograd's in-place (version) check
        # ``do`` is never None: autograd materialises an unused output's gradient as zeros
        grads = tuple(ctx.ops._gdn_backward(ctx.entry, do))
        if graph_is_released():  # the saved set (its context, its group) goes now
            ctx.entry = None
        return (None,) * 7 + grads


def _list(xs, W: int, name: str) -> list:
    if not isinstance(xs, (list, tuple)) or len(xs) != W:
        raise ValueError(f"{name} must be a list of {W} tensors (one per rank)")
    return list(xs)


_DEFINED: dict[str, KCPOps] = {}


def define_kcp_ops(namespace: str, *, deterministic: bool, context_cls: type, saved_cls: type,
                   workspace_cls: type, grads_cls: type) -> KCPOps:
    """Register the KCP ops in ``namespace`` (once per process; a second call returns
    the same :class:`KCPOps`, ``ValueError`` if the mode differs)."""
    got = _DEFINED.get(namespace)
    if got is not None:
        if got.deterministic != deterministic:
            raise ValueError(f"namespace {namespace!r} already holds the "
                             f"deterministic={got.deterministic} ops")
        return got
    ops = KCPOps(namespace, deterministic=bool(deterministic), context_cls=context_cls,
                 saved_cls=saved_cls, workspace_cls=workspace_cls, grads_cls=grads_cls)
    _DEFINED[namespace] = ops
    return ops
