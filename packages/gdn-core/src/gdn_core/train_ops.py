"""Custom ops of the single-rank training packages (GDN kernel and causal conv1d).

:func:`define_train_ops` registers, in a package's namespace ``ns``:

* ``ns::chunk_gated_delta_rule`` → ``(o, final_state, token)`` and
  ``ns::chunk_gated_delta_rule_bwd`` (its registered backward) — the gated GDN
  of :func:`gdn_core.autograd.gated_gdn_fwd` / ``gated_gdn_bwd`` in the
  package's mode;
* ``ns::causal_conv1d`` → ``(y, token)`` and ``ns::causal_conv1d_bwd``.

Schemas: every optional tensor is ``Tensor?``; ``cu_seqlens`` is a tensor (its
length fixes the document count the fake implementation needs); host
metadata never crosses the schema as a Python object. The packages' public
calls route through :meth:`TrainOps.chunk_gated_delta_rule` /
:meth:`TrainOps.causal_conv1d`, which pick what the ops get:

* ``cu_seqlens`` a list or a tensor — eagerly, it is validated once on the
  host (a CUDA tensor costs that one synchronisation, as before) and passed as
  a CPU int64 tensor, so neither the forward nor the backward op reads a
  device tensor on the host. Under ``torch.compile`` it is passed as is: give
  a **CPU** tensor (a graph input: no recompilation per layout, no sync), or a
  list (a constant: one graph per layout).
* ``cu_seqlens`` a :class:`gdn_core.layout.VarlenLayout` — the op gets the
  layout's handle and its padded device ``cu_seqlens``; the kernels read the
  layout's fixed-size device tables (CUDA-graph replay across layouts).
* ``workspace`` — through its handle.

The forward's saved set (the :class:`gdn_core.compose.GDNSaved` etc.) rides in
the stash of :mod:`gdn_core.custom_ops`, keyed by the token; the inputs the
backward reads are passed to the backward op again (AOTAutograd saves them).
Results are bitwise those of the eager autograd path
(:func:`gdn_core.autograd.chunk_gdn_autograd`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gdn_core.autograd import GateSaved, gated_gdn_bwd, gated_gdn_fwd, validate_gated_inputs
from gdn_core.compose import GDNSaved
from gdn_core.conv1d import causal_conv1d_bwd, causal_conv1d_fwd, validate_conv1d_inputs
from gdn_core.custom_ops import (
    autograd_enabled,
    define_op,
    is_compiling,
    lookup,
    object_handle,
    stash_get,
    stash_put,
)
from gdn_core.layout import VarlenLayout

__all__ = ["TrainOps", "define_train_ops"]

Tensor = torch.Tensor


def _empty(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return like.new_empty(0, dtype=dtype)


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _token_fake() -> Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


def _layout_of(cu_seqlens: Tensor | None, layout: Tensor | None, T: int):
    """``(host offsets | None, chunk index | None, doc_pos | None, layout | None)``."""
    if layout is not None:
        lay = lookup(layout, "cu_seqlens (VarlenLayout)")
        if not isinstance(lay, VarlenLayout):
            raise ValueError(f"layout handle names a {type(lay).__name__}, not a VarlenLayout")
        if lay.total_tokens != T:
            raise ValueError(f"the layout covers T={lay.total_tokens} tokens, the inputs hold {T}")
        if cu_seqlens is not None and tuple(cu_seqlens.shape) != (lay.max_docs + 1,):
            raise ValueError("cu_seqlens does not match the layout's padded table")
        return list(lay.padded_offsets), lay.index, lay.doc_pos, lay
    if cu_seqlens is None:
        return None, None, None, None
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
        raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                        f"{tuple(cu_seqlens.shape)}")
    # a CPU tensor (what the public calls pass) is read without any synchronisation
    return [int(x) for x in cu_seqlens.tolist()], None, None, None


def _layout_segment_size(segment_size: int | None) -> int:
    """A :class:`VarlenLayout` runs the plain chunked path (``segment_size=0``): the
    segment tables would follow the layout, the kernels must read only the
    layout's fixed-size ones (see :mod:`gdn_core.layout`)."""
    if segment_size not in (None, 0):
        raise ValueError(
            f"a VarlenLayout runs without segments (segment_size=0), got segment_size="
            f"{segment_size!r}: pass a list or tensor cu_seqlens to use segments"
        )
    return 0


@dataclass
class _GDNEntry:
    core: GDNSaved
    gate: GateSaved | None
    workspace: Any
    layout: Any
    output_final_state: bool


@dataclass
class _ConvEntry:
    offsets: list[int] | None
    doc_pos: Tensor | None
    layout: Any
    activation: str | None


class TrainOps:
    """The ops of one namespace and the calls that route a package's public API to them.

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
        ) -> tuple[Tensor, Tensor, Tensor]:
            offsets, index, _, lay = _layout_of(cu_seqlens, layout, q.shape[1])
            if lay is not None:
                segment_size = _layout_segment_size(segment_size)
            ws = lookup(workspace, "workspace") if workspace is not None else None
            o, final, core, gate = gated_gdn_fwd(
                q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=offsets,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                deterministic=det, backend=backend, workspace=ws, index=index,
                segment_size=segment_size,
            )
            if final is None:
                final = _empty(o, _state_dtype(q))
            token = stash_put(
                _GDNEntry(core, gate, ws, lay, output_final_state),
                args=(q, k, v, g, beta, initial_state, A_log, dt_bias), outs=(o, final),
            )
            return o, final, token

        def gdn_fwd_fake(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, layout,
                         workspace, scale, output_final_state, use_qk_l2norm_in_kernel,
                         use_gate_in_kernel, backend, segment_size):
            B, T, HV, V = v.shape
            K = q.shape[-1]
            N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
            o = v.new_empty(B, T, HV, V)
            shape = (N, HV, K, V) if output_final_state else (0,)
            final = q.new_empty(shape, dtype=_state_dtype(q))
            return o, final, _token_fake()

        def gdn_bwd(
            do: Tensor, dfinal: Tensor | None, token: Tensor,
            q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            initial_state: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
            e = stash_get(token, (q, k, v, g, beta, initial_state, A_log, dt_bias))
            dht = dfinal if (e.output_final_state and dfinal is not None) else None
            with autograd_enabled():  # the reference backend differentiates its fp32 oracle
                grads, dA_log, ddt_bias = gated_gdn_bwd(
                    e.core, e.gate, do.contiguous(), dht, deterministic=det,
                    workspace=e.workspace,
                )
            dh0 = grads.dh0
            if initial_state is not None and dh0 is not None:
                dh0 = dh0.to(initial_state.dtype)
            else:
                dh0 = _empty(do, torch.float32)
            return (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, dh0,
                    dA_log if dA_log is not None else _empty(do, torch.float32),
                    ddt_bias if ddt_bias is not None else _empty(do, torch.float32))

        def gdn_bwd_fake(do, dfinal, token, q, k, v, g, beta, initial_state, A_log, dt_bias):
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
            q, k, v, g, beta, h0, A_log, dt_bias = inputs[:8]
            ctx.save_for_backward(output[2], q, k, v, g, beta, h0, A_log, dt_bias)

        def backward(ctx, do, dfinal, _dtoken):
            token, q, k, v, g, beta, h0, A_log, dt_bias = ctx.saved_tensors
            if do is None:
                do = torch.zeros_like(v)
            dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = bwd_op(
                do, dfinal, token, q, k, v, g, beta, h0, A_log, dt_bias)
            return (dq, dk, dv, dg, dbeta,
                    dh0 if h0 is not None else None,
                    dA_log if A_log is not None else None,
                    ddt_bias if dt_bias is not None else None,
                    None, None, None, None, None, None, None, None, None)

        self.gdn_bwd = bwd_op
        self.gdn = define_op(self.namespace, "chunk_gated_delta_rule", gdn_fwd,
                             fake=gdn_fwd_fake, backward=backward, setup_context=setup_context)

    def chunk_gated_delta_rule(
        self, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
        dt_bias=None, workspace=None, backend=None, segment_size=None,
    ) -> tuple[Tensor, Tensor | None]:
        """Differentiable gated GDN through the ops: ``(o, final_state or None)``."""
        layout = None
        if isinstance(cu_seqlens, VarlenLayout):
            layout, cu_seqlens = cu_seqlens.handle, cu_seqlens.cu_seqlens
            if not is_compiling():
                _layout_segment_size(segment_size)
        elif not is_compiling():
            # eager: every check first (as the autograd path does), host offsets once
            shapes, _ = validate_gated_inputs(
                q, k, v, g, beta, scale=scale, initial_state=initial_state,
                cu_seqlens=cu_seqlens, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                dt_bias=dt_bias, backend=backend, workspace=workspace,
                segment_size=segment_size,
            )
            if cu_seqlens is not None:
                cu_seqlens = torch.tensor(shapes.offsets, dtype=torch.int64)
        elif isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
        ws = object_handle(workspace, "workspace") if workspace is not None else None
        o, final, _ = self.gdn(
            q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, layout, ws,
            None if scale is None else float(scale), bool(output_final_state),
            bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), backend, segment_size,
        )
        return o, (final if output_final_state else None)

    # ------------------------------------------------------------- conv --

    def _define_conv(self) -> None:
        det = self.deterministic

        def conv_fwd(
            x: Tensor, weight: Tensor, bias: Tensor | None, halo: Tensor | None,
            cu_seqlens: Tensor | None, layout: Tensor | None, activation: str | None,
        ) -> tuple[Tensor, Tensor]:
            offsets, _, doc_pos, lay = _layout_of(cu_seqlens, layout, x.shape[1])
            if lay is not None:
                offsets = None
            y = causal_conv1d_fwd(x, weight, bias, activation, offsets, halo,
                                  deterministic=det, doc_pos=doc_pos)
            token = stash_put(_ConvEntry(offsets, doc_pos, lay, activation))
            return y, token

        def conv_fwd_fake(x, weight, bias, halo, cu_seqlens, layout, activation):
            return torch.empty_like(x, memory_format=torch.contiguous_format), _token_fake()

        def conv_bwd(
            dy: Tensor, token: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
            halo: Tensor | None,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            e = stash_get(token)
            dx, dw, db, dhalo = causal_conv1d_bwd(
                x, weight, bias, dy.contiguous(), e.activation, e.offsets, halo,
                deterministic=det, doc_pos=e.doc_pos,
            )
            return (dx, dw, db if db is not None else _empty(dy),
                    dhalo if dhalo is not None else _empty(dy))

        def conv_bwd_fake(dy, token, x, weight, bias, halo):
            def like(t):
                return torch.empty_like(t, memory_format=torch.contiguous_format)

            return (like(x), like(weight), like(bias) if bias is not None else dy.new_empty(0),
                    like(halo) if halo is not None else dy.new_empty(0))

        bwd_op = define_op(self.namespace, "causal_conv1d_bwd", conv_bwd, fake=conv_bwd_fake)

        def setup_context(ctx, inputs, output):
            x, weight, bias, halo = inputs[:4]
            ctx.save_for_backward(output[1], x, weight, bias, halo)

        def backward(ctx, dy, _dtoken):
            token, x, weight, bias, halo = ctx.saved_tensors
            dx, dw, db, dhalo = bwd_op(dy, token, x, weight, bias, halo)
            return (dx, dw, db if bias is not None else None,
                    dhalo if halo is not None else None, None, None, None)

        self.conv_bwd = bwd_op
        self.conv = define_op(self.namespace, "causal_conv1d", conv_fwd, fake=conv_fwd_fake,
                              backward=backward, setup_context=setup_context)

    def causal_conv1d(self, x, weight, bias=None, activation="silu", cu_seqlens=None,
                      halo=None) -> Tensor:
        """Differentiable causal depthwise conv1d through the ops (see :mod:`gdn_core.conv1d`)."""
        layout = None
        if isinstance(cu_seqlens, VarlenLayout):
            layout, cu_seqlens = cu_seqlens.handle, None
            if not is_compiling():
                validate_conv1d_inputs(x, weight, bias, activation, None, halo)
        elif not is_compiling():
            offsets = validate_conv1d_inputs(x, weight, bias, activation, cu_seqlens, halo)
            if offsets is not None:
                cu_seqlens = torch.tensor(offsets, dtype=torch.int64)
        elif isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
        y, _ = self.conv(x, weight, bias, halo, cu_seqlens, layout, activation)
        return y


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
