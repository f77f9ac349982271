"""Custom ops of the single-rank training packages (GDN kernel and causal conv1d).

:func:`define_train_ops` registers, in a package's namespace ``ns``, four flat
ops — tensors and scalars in, tensors out; nothing rides beside the schema:

* ``ns::chunk_gated_delta_rule`` → ``(o, final_state, *saved)`` and its
  registered backward ``ns::chunk_gated_delta_rule_bwd``, which receives the
  forward's inputs and ``saved`` back (:data:`SAVED_OUTPUTS`: what the forward
  made that the backward reads — the L2-normalised q/k and their inverse norms,
  the gate's output, ``G``, ``A_inv``, the segments' entry states and
  summaries; empty where the plan has none). AOTAutograd saves them like any
  activation.
* ``ns::causal_conv1d`` → ``y`` and ``ns::causal_conv1d_bwd``.

Both ops of a pair find the call's :class:`~gdn_core.plan.GDNPlan` by the same
key (:func:`~gdn_core.plan.make_plan`): the public call made it (validating
once), the ops look it up. The shapes of every output are functions of the
inputs' shapes and the scalars (the saved segment rows are an upper bound,
:func:`~gdn_core.plan.saved_state_rows`), which is what the fake
implementations return: ``torch.compile(fullgraph=True)`` traces the ops, and
a CPU ``cu_seqlens`` tensor is a graph input (no recompilation per layout).

``cu_seqlens`` reaches the ops as a CPU int64 tensor (eagerly, the plan's; a
CUDA tensor costs the public call one synchronisation, once per layout), or
under ``torch.compile`` as given (a CPU tensor, or a list made a constant). A
:class:`~gdn_core.layout.VarlenLayout` and a workspace reach them through
their handles (:mod:`gdn_core.custom_ops`): objects with fixed-size device
buffers that the caller keeps alive. Results are bitwise those of the split
API and of :func:`gdn_core.autograd.chunk_gdn_autograd`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from gdn_core.compose import bwd, fwd
from gdn_core.conv1d import causal_conv1d_bwd, causal_conv1d_fwd, validate_conv1d_inputs
from gdn_core.custom_ops import autograd_enabled, define_op, lookup
from gdn_core.layout import VarlenLayout
from gdn_core.ops.wy import inverse_for_backward
from gdn_core.plan import GDNPlan, make_plan, resolve_backend, saved_state_rows
from gdn_core.saved import GateSaved, GDNSaved

__all__ = ["SAVED_OUTPUTS", "TrainOps", "define_train_ops", "layout_of", "layout_segment_size",
           "op_plan"]

Tensor = torch.Tensor

#: The forward op's outputs after ``(o, final_state)``, in order.
SAVED_OUTPUTS = ("q_used", "k_used", "q_rstd", "k_rstd", "g_used", "G", "A_inv", "seg_states",
                 "seg_summ")


def layout_segment_size(segment_size: int | None) -> int:
    """A :class:`VarlenLayout` runs the plain chunked path (``segment_size=0``): the
    segment tables would follow the layout, the kernels must read only the
    layout's fixed-size ones (see :mod:`gdn_core.layout`)."""
    if segment_size not in (None, 0):
        raise ValueError(
            f"a VarlenLayout runs without segments (segment_size=0), got segment_size="
            f"{segment_size!r}: pass a list or tensor cu_seqlens to use segments"
        )
    return 0


def layout_of(layout: Tensor | VarlenLayout, tokens: int) -> VarlenLayout:
    """The :class:`VarlenLayout` of a call — given itself (eagerly) or its handle (an op's
    argument) — checked to cover ``tokens`` tokens.

    Raises:
        ValueError: the handle names no live layout, or another object; the layout
            covers another number of tokens.
    """
    lay = layout if isinstance(layout, VarlenLayout) else lookup(
        layout, "cu_seqlens (VarlenLayout)")
    if not isinstance(lay, VarlenLayout):
        raise ValueError(f"layout handle names a {type(lay).__name__}, not a VarlenLayout")
    if lay.total_tokens != tokens:
        raise ValueError(f"the layout covers T={lay.total_tokens} tokens, the inputs hold "
                         f"{tokens}")
    return lay


def op_plan(deterministic: bool, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
             layout, scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
             backend, segment_size) -> GDNPlan:
    """The plan of a call: the public call's, from the cache (``layout``: a
    :class:`VarlenLayout` or its handle, checked against the inputs, :func:`layout_of`)."""
    index = None
    if layout is not None:
        lay = layout_of(layout, q.shape[1])
        if cu_seqlens is not None and tuple(cu_seqlens.shape) != (lay.max_docs + 1,):
            raise ValueError("cu_seqlens does not match the layout's padded table")
        cu_seqlens, index = lay.padded_offsets, lay.index
        segment_size = layout_segment_size(segment_size)
    return make_plan(q, k, v, g, beta, deterministic=deterministic, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                     backend=backend, segment_size=segment_size, index=index)


def _saved_outputs(plan: GDNPlan, saved: GDNSaved, like: Tensor) -> tuple[Tensor, ...]:
    """The forward op's :data:`SAVED_OUTPUTS` from the composition's saved set
    (a fresh empty tensor where the plan has none: outputs never alias)."""
    s = plan.shapes
    sd = torch.float64 if saved.q.dtype == torch.float64 else torch.float32
    rows = plan.state_rows
    if rows:
        states = like.new_empty(rows, s.HV, s.K, s.V, dtype=sd)
        summ = like.new_empty(rows, s.HV, s.K, s.V + s.K, dtype=sd)
        if saved.seg_states is not None:
            states[: saved.seg_states.shape[0]].copy_(saved.seg_states)
        if saved.seg_summ is not None:
            summ[: saved.seg_summ.shape[0]].copy_(saved.seg_summ)
    else:
        states, summ = like.new_empty(0, dtype=sd), like.new_empty(0, dtype=sd)
    if plan.use_qk_l2norm_in_kernel and plan.backend == "triton":
        qk = (saved.q, saved.k, saved.q_rstd, saved.k_rstd)
    else:
        qk = (like.new_empty(0, dtype=sd), like.new_empty(0, dtype=sd),
              like.new_empty(0, dtype=sd), like.new_empty(0, dtype=sd))
    g = saved.g if plan.use_gate_in_kernel else like.new_empty(0, dtype=sd)
    if saved.G is None:  # the reference backend recomputes everything from the inputs
        G, A_inv = like.new_empty(0, dtype=sd), like.new_empty(0, dtype=sd)
    else:
        G, A_inv = saved.G, saved.A_inv
    return (*qk, g, G, A_inv, states, summ)


def _saved_from_op(plan: GDNPlan, q, k, v, g, beta, initial_state, q_used, k_used, q_rstd,
                   k_rstd, g_used, G, A_inv, seg_states, seg_summ) -> GDNSaved:
    """The composition's saved set rebuilt from the backward op's arguments (the
    forward op's inputs and :data:`SAVED_OUTPUTS`): the very tensors, or the
    same values (the flat contiguous inputs) where the forward's were views."""
    s, L = plan.shapes, plan.segments
    if plan.use_gate_in_kernel:
        g = g_used
    nseg = L.num_segments
    states = None if L.trivial else seg_states[:nseg]
    summ = seg_summ[:nseg] if any(L.need_E) else None
    segments = None if L.trivial else L  # a saved set without segments: the plain path
    if plan.backend != "triton":
        return GDNSaved(plan.deterministic, plan.backend, s, plan.scale,
                        plan.use_qk_l2norm_in_kernel, q, k, v, g, beta, initial_state,
                        segments=segments, seg_states=states, seg_summ=summ)
    BT = s.B * s.T
    l2 = plan.use_qk_l2norm_in_kernel
    if not l2:
        q_used, k_used = q.reshape(BT, s.H, s.K).contiguous(), k.reshape(BT, s.H, s.K).contiguous()
        q_rstd = k_rstd = None
    return GDNSaved(
        plan.deterministic, "triton", s, plan.scale, l2, q_used, k_used,
        v.reshape(BT, s.HV, s.V).contiguous(), g.reshape(BT, s.HV).contiguous(),
        beta.reshape(BT, s.HV).contiguous(), initial_state, index=plan.index, G=G,
        q_rstd=q_rstd, k_rstd=k_rstd, segments=segments, seg_states=states, seg_summ=summ,
        A_inv=A_inv,
    )


class TrainOps:
    """The ops of one namespace (the public calls that reach them:
    :class:`gdn_core.frontend.SingleRankAPI`).

    Attributes: ``gdn``, ``gdn_bwd``, ``conv``, ``conv_bwd`` — the registered
    ops (``torch.ops.<ns>.<name>``); ``namespace``; ``deterministic``.
    """

    def __init__(self, namespace: str, deterministic: bool) -> None:
        self.namespace = namespace
        self.deterministic = deterministic
        self._define_gdn()
        self._define_conv()

    # ------------------------------------------------------------- GDN --

    def _define_gdn(self) -> None:
        det = self.deterministic

        def gdn_fwd(
            q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            initial_state: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None,
            cu_seqlens: Tensor | None, layout: Tensor | None, workspace: Tensor | None,
            scale: float | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
            use_gate_in_kernel: bool, backend: str | None, segment_size: int | None,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                   Tensor, Tensor]:
            plan = op_plan(det, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                            layout, scale, output_final_state, use_qk_l2norm_in_kernel,
                            use_gate_in_kernel, backend, segment_size)
            o, final, saved, _ = fwd(plan, q, k, v, g, beta, initial_state, A_log, dt_bias)
            if final is None:
                final = v.new_empty(0, dtype=torch.float64 if q.dtype == torch.float64
                                    else torch.float32)
            return (o, final, *_saved_outputs(plan, saved, v))

        def gdn_fwd_fake(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, layout,
                         workspace, scale, output_final_state, use_qk_l2norm_in_kernel,
                         use_gate_in_kernel, backend, segment_size):
            B, T, HV, V = v.shape
            H, K = q.shape[2], q.shape[3]
            BT = B * T
            N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
            sd = torch.float64 if q.dtype == torch.float64 else torch.float32
            triton = resolve_backend(q.device, q.dtype, backend) == "triton"
            l2 = use_qk_l2norm_in_kernel and triton
            rows = 0 if layout is not None else saved_state_rows(N, T, BT, segment_size)
            gate_dt = (torch.float64 if torch.float64 in (g.dtype, A_log.dtype, dt_bias.dtype)
                       else torch.float32) if use_gate_in_kernel else None
            a_inv = inverse_for_backward(v.new_empty(0, HV, 64, dtype=torch.float32),
                                         q.new_empty(0, H, K), v.new_empty(0, HV, V))

            def empty():
                return v.new_empty(0, dtype=sd)

            return (
                v.new_empty(B, T, HV, V),
                v.new_empty((N, HV, K, V) if output_final_state else (0,), dtype=sd),
                q.new_empty(BT, H, K) if l2 else empty(), q.new_empty(BT, H, K) if l2 else empty(),
                v.new_empty(BT, H, dtype=torch.float32) if l2 else empty(),
                v.new_empty(BT, H, dtype=torch.float32) if l2 else empty(),
                ((v.new_empty(BT, HV, dtype=gate_dt) if triton else
                  v.new_empty(B, T, HV, dtype=gate_dt)) if use_gate_in_kernel else empty()),
                v.new_empty(BT, HV, dtype=torch.float32) if triton else empty(),
                v.new_empty(BT, HV, 64, dtype=a_inv.dtype) if triton else empty(),
                v.new_empty(rows, HV, K, V, dtype=sd) if rows else empty(),
                v.new_empty(rows, HV, K, V + K, dtype=sd) if rows else empty(),
            )

        def gdn_bwd(
            do: Tensor, dfinal: Tensor | None,
            q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            initial_state: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None,
            cu_seqlens: Tensor | None, layout: Tensor | None, workspace: Tensor | None,
            q_used: Tensor, k_used: Tensor, q_rstd: Tensor, k_rstd: Tensor, g_used: Tensor,
            G: Tensor, A_inv: Tensor, seg_states: Tensor, seg_summ: Tensor,
            scale: float | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
            use_gate_in_kernel: bool, backend: str | None, segment_size: int | None,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
            plan = op_plan(det, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                            layout, scale, output_final_state, use_qk_l2norm_in_kernel,
                            use_gate_in_kernel, backend, segment_size)
            saved = _saved_from_op(plan, q, k, v, g, beta, initial_state, q_used, k_used,
                                   q_rstd, k_rstd, g_used, G, A_inv, seg_states, seg_summ)
            gate = GateSaved(g, A_log, dt_bias) if use_gate_in_kernel else None
            ws = None
            if workspace is not None:
                ws = lookup(workspace, "workspace").core_for(saved)
            dht = dfinal if (output_final_state and dfinal is not None) else None
            # the reference backend differentiates its fp32 oracle: autograd inside the op
            with autograd_enabled() if plan.backend == "reference" else nullcontext():
                grads, dA_log, ddt_bias = bwd(saved, gate, do.contiguous(), dht, workspace=ws)
            # a fresh empty tensor where a gradient has no input: outputs never alias
            f32 = torch.float32
            dh0 = (do.new_empty(0, dtype=f32) if initial_state is None
                   else grads.dh0.to(initial_state.dtype))
            return (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, dh0,
                    do.new_empty(0, dtype=f32) if dA_log is None else dA_log,
                    do.new_empty(0, dtype=f32) if ddt_bias is None else ddt_bias)

        def gdn_bwd_fake(do, dfinal, q, k, v, g, beta, initial_state, A_log, dt_bias, *_):
            def like(x):
                return torch.empty_like(x, memory_format=torch.contiguous_format)

            none = do.new_empty(0, dtype=torch.float32)
            return (like(q), like(k), like(v), like(g), like(beta),
                    like(initial_state) if initial_state is not None else none,
                    like(A_log) if A_log is not None else none,
                    like(dt_bias) if dt_bias is not None else none.clone())

        bwd_op = define_op(self.namespace, "chunk_gated_delta_rule_bwd", gdn_bwd,
                           fake=gdn_bwd_fake)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:11], *output[2:])
            ctx.scalars = inputs[11:]

        def backward(ctx, do, dfinal, *_saved_grads):
            q, k, v, g, beta, h0, A_log, dt_bias = ctx.saved_tensors[:8]
            if do is None:
                do = torch.zeros_like(v)
            dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = bwd_op(
                do, dfinal, *ctx.saved_tensors, *ctx.scalars)
            return (dq, dk, dv, dg, dbeta,
                    dh0 if h0 is not None else None,
                    dA_log if A_log is not None else None,
                    ddt_bias if dt_bias is not None else None,
                    None, None, None, None, None, None, None, None, None)

        self.gdn_bwd = bwd_op
        self.gdn = define_op(self.namespace, "chunk_gated_delta_rule", gdn_fwd,
                             fake=gdn_fwd_fake, backward=backward, setup_context=setup_context)

    # ------------------------------------------------------------- conv --

    def _define_conv(self) -> None:
        det = self.deterministic

        def conv_args(x: Tensor, cu_seqlens: Tensor | None, layout: Tensor | None
                      ) -> tuple[Any, Any]:
            """``(host offsets | None, doc_pos | None)`` of an op call."""
            if layout is not None:
                return None, layout_of(layout, x.shape[1]).doc_pos
            if cu_seqlens is None:
                return None, None
            if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
                raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got "
                                f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
            return cu_seqlens.tolist(), None  # a CPU tensor: no synchronisation

        def conv_fwd(
            x: Tensor, weight: Tensor, bias: Tensor | None, halo: Tensor | None,
            cu_seqlens: Tensor | None, layout: Tensor | None, activation: str | None,
        ) -> Tensor:
            offsets, doc_pos = conv_args(x, cu_seqlens, layout)
            return causal_conv1d_fwd(x, weight, bias, activation, offsets, halo,
                                     deterministic=det, doc_pos=doc_pos)

        def conv_fwd_fake(x, weight, bias, halo, cu_seqlens, layout, activation):
            return torch.empty_like(x, memory_format=torch.contiguous_format)

        def conv_bwd(
            dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, halo: Tensor | None,
            cu_seqlens: Tensor | None, layout: Tensor | None, activation: str | None,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            offsets, doc_pos = conv_args(x, cu_seqlens, layout)
            dx, dw, db, dhalo = causal_conv1d_bwd(
                x, weight, bias, dy.contiguous(), activation, offsets, halo,
                deterministic=det, doc_pos=doc_pos,
            )
            return (dx, dw, db if db is not None else dy.new_empty(0),
                    dhalo if dhalo is not None else dy.new_empty(0))

        def conv_bwd_fake(dy, x, weight, bias, halo, cu_seqlens, layout, activation):
            def like(t):
                return torch.empty_like(t, memory_format=torch.contiguous_format)

            return (like(x), like(weight), like(bias) if bias is not None else dy.new_empty(0),
                    like(halo) if halo is not None else dy.new_empty(0))

        bwd_op = define_op(self.namespace, "causal_conv1d_bwd", conv_bwd, fake=conv_bwd_fake)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:6])
            ctx.activation = inputs[6]

        def backward(ctx, dy):
            x, weight, bias, halo, cu, layout = ctx.saved_tensors
            dx, dw, db, dhalo = bwd_op(dy, x, weight, bias, halo, cu, layout, ctx.activation)
            return (dx, dw, db if bias is not None else None,
                    dhalo if halo is not None else None, None, None, None)

        self.conv_bwd = bwd_op
        self.conv = define_op(self.namespace, "causal_conv1d", conv_fwd, fake=conv_fwd_fake,
                              backward=backward, setup_context=setup_context)

    def causal_conv1d(self, x, weight, bias=None, activation="silu", cu_seqlens=None,
                      halo=None) -> Tensor:
        """Differentiable causal depthwise conv1d (see :mod:`gdn_core.conv1d`): eagerly
        through :class:`_ConvFunction`, under ``torch.compile`` through the op (the same
        bodies, the same bits)."""
        if not torch.compiler.is_compiling():
            doc_pos = offsets = None
            if isinstance(cu_seqlens, VarlenLayout):
                validate_conv1d_inputs(x, weight, bias, activation, None, halo)
                doc_pos = layout_of(cu_seqlens, x.shape[1]).doc_pos
            else:
                offsets = validate_conv1d_inputs(x, weight, bias, activation, cu_seqlens, halo)
            return _ConvFunction.apply(self.deterministic, activation, offsets, doc_pos, x,
                                       weight, bias, halo)
        layout = None
        if isinstance(cu_seqlens, VarlenLayout):
            layout, cu_seqlens = cu_seqlens.handle, None
        elif isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
        return self.conv(x, weight, bias, halo, cu_seqlens, layout, activation)


class _ConvFunction(torch.autograd.Function):
    """The eager form of ``ns::causal_conv1d``: the same forward and backward
    (:func:`~gdn_core.conv1d.causal_conv1d_fwd` / ``_bwd``) without the op's dispatch;
    the inputs are saved for autograd's in-place check."""

    @staticmethod
    def forward(ctx, deterministic, activation, offsets, doc_pos, x, weight, bias, halo):
        ctx.save_for_backward(x, weight, bias, halo)
        ctx.args = (deterministic, activation, offsets, doc_pos)
        return causal_conv1d_fwd(x, weight, bias, activation, offsets, halo,
                                 deterministic=deterministic, doc_pos=doc_pos)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, halo = ctx.saved_tensors
        deterministic, activation, offsets, doc_pos = ctx.args
        dx, dw, db, dhalo = causal_conv1d_bwd(x, weight, bias, dy.contiguous(), activation,
                                              offsets, halo, deterministic=deterministic,
                                              doc_pos=doc_pos)
        return None, None, None, None, dx, dw, db, dhalo


_DEFINED: dict[str, TrainOps] = {}


def define_train_ops(namespace: str, *, deterministic: bool) -> TrainOps:
    """Register the single-rank training ops in ``namespace`` (once per process;
    a second call returns the same :class:`TrainOps`, ``ValueError`` if the mode differs)."""
    got = _DEFINED.get(namespace)
    if got is not None:
        if got.deterministic != deterministic:
            raise ValueError(f"namespace {namespace!r} already holds the "
                             f"deterministic={got.deterministic} ops")
        return got
    ops = TrainOps(namespace, bool(deterministic))
    _DEFINED[namespace] = ops
    return ops
