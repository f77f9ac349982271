"""The one composition of the chunked GDN algorithm: :func:`fwd` and :func:`bwd`.

Every call — single rank, every layout — runs the segment algorithm of
:mod:`gdn_core.segment` from a :class:`~gdn_core.plan.GDNPlan`: the chunk-local
stages and the summaries of segments with a successor, the fixed-order fp32
fold of those summaries into entry states, then every segment's recurrence and
output from its entry state; the backward mirrors it. A layout in which every
document is one segment (documents no longer than ``segment_size``,
``segment_size=0``, a :class:`~gdn_core.layout.VarlenLayout`) has no summaries
and no fold: the plain chunked recurrence, as a special case, not as a second
copy. The optional in-kernel gate ``g = −exp(A_log)·softplus(g_raw + dt_bias)``
(:mod:`gdn_core.gate`) runs in front of it and its backward behind it. The
context-parallel path (:mod:`gdn_core.kcp.compose`) runs the same phases with
the exchange between them.

The bits depend on ``segment_size`` (a deterministic run is repeatable for a
fixed one, and a context-parallel run of a ``"segment"`` plan with the same
size gives the same bits for any number of ranks).

:func:`chunk_gdn_fwd` / :func:`chunk_gdn_bwd` are ``gdn_core``'s own
validated entry points (plan, then :func:`fwd` / :func:`bwd`).
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.gate import gate_bwd, gate_fwd
from gdn_core.plan import GDNPlan, make_plan, resolve_backend
from gdn_core.saved import GateSaved, GDNGrads, GDNSaved
from gdn_core.segment import (
    segment_bwd_begin,
    segment_bwd_finish,
    segment_bwd_fold,
    segment_fwd_begin,
    segment_fwd_finish,
    segment_fwd_fold,
)
from gdn_core.validation import GDNShapes, check_bool, check_input_values

__all__ = ["GDNGrads", "GDNSaved", "bwd", "chunk_gdn_bwd", "chunk_gdn_fwd", "fwd",
           "resolve_backend"]


def fwd(
    plan: GDNPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, GDNSaved, GateSaved | None]:
    """The forward of a planned call (inputs as validated by :func:`~gdn_core.plan.make_plan`).

    ``q, k: [B,T,H,K]``, ``v: [B,T,HV,V]``, ``g, beta: [B,T,HV]`` (``g`` the raw
    gate input with ``plan.use_gate_in_kernel``), ``initial_state: [N,HV,K,V]``.
    Returns ``(o [B,T,HV,V] in v's dtype, final_state [N,HV,K,V] fp32 or None,
    saved, gate)``: the :class:`~gdn_core.saved.GDNSaved` and the gate's inputs
    (``None`` without the gate) for :func:`bwd`.
    """
    gate = None
    if plan.use_gate_in_kernel:
        gate = GateSaved(g, A_log, dt_bias)
        g = gate_fwd(g, A_log, dt_bias)
    st = segment_fwd_begin(
        q, k, v, g, beta, layout=plan.segments, scale=plan.scale,
        use_qk_l2norm_in_kernel=plan.use_qk_l2norm_in_kernel, initial_state=initial_state,
        backend=plan.backend, deterministic=plan.deterministic, shapes=plan.shapes,
        index=plan.index,
    )
    segment_fwd_fold(st)
    o, final, saved = segment_fwd_finish(st, output_final_state=plan.output_final_state)
    return o, final, saved, gate


def bwd(
    saved: GDNSaved,
    gate: GateSaved | None,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    *,
    workspace: object | None = None,
) -> tuple[GDNGrads, torch.Tensor | None, torch.Tensor | None]:
    """The backward of :func:`fwd` (arguments checked by the caller).

    ``do: [B,T,HV,V]``; ``dht: [N,HV,K,V]`` or ``None``; ``workspace``: a
    :class:`gdn_core.ops.backward.BackwardWorkspace` of the saved set's mode
    (triton backend) or ``None``. Returns ``(grads, dA_log, ddt_bias)``; with
    the gate ``grads.dg`` is for the raw gate input, else the last two are ``None``.
    """
    bst = segment_bwd_begin(saved, do, dht, deterministic=saved.deterministic,
                            workspace=workspace)
    segment_bwd_fold(bst)
    grads = segment_bwd_finish(bst)
    if gate is None:
        return grads, None, None
    grads.dg, dA_log, ddt_bias = gate_bwd(gate.g_raw, gate.A_log, gate.dt_bias, grads.dg,
                                          deterministic=saved.deterministic)
    return grads, dA_log, ddt_bias


def chunk_gdn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    deterministic: bool,
    backend: str | None = None,
    index: ChunkIndex | None = None,
    segment_size: int | None = None,
    shapes: GDNShapes | None = None,
    check_inputs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, GDNSaved]:
    """Chunked GDN forward, validated: :func:`~gdn_core.plan.make_plan` then :func:`fwd`.

    Shapes: ``q, k: [B,T,H,K]``; ``v: [B,T,HV,V]``; ``g, beta: [B,T,HV]``;
    ``initial_state: [N,HV,K,V]``; ``cu_seqlens: [N+1]`` (``B == 1``). ``index``
    may pass a prebuilt :class:`ChunkIndex` of the same layout (saves the host
    work and, for a CUDA ``cu_seqlens``, a synchronisation). ``segment_size``:
    the segment length (a multiple of 64; ``0``: no segments; ``None``:
    :func:`gdn_core.segment.choose_segment_size` picks). ``shapes``: accepted
    for compatibility and unused (the plan cache makes a repeated validation free).

    Returns ``(o [B,T,HV,V] in v's dtype, final_state [N,HV,K,V] fp32 or None,
    saved)``. Raises ``TypeError``/``ValueError`` for bad input (see
    :func:`gdn_core.validation.validate_gdn_inputs`); with ``check_inputs=True``
    (one host synchronisation) ``ValueError`` for ``g > 0`` or NaN and ``beta``
    outside ``[0, 1]`` (:func:`gdn_core.validation.check_input_values`).
    ``g = -inf`` is a full reset (:data:`gdn_core.chunking.MIN_LOG_DECAY`).
    """
    del shapes
    plan = make_plan(q, k, v, g, beta, deterministic=deterministic, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     backend=backend, segment_size=segment_size, index=index)
    if check_bool("check_inputs", check_inputs):
        msg = check_input_values(g, beta)
        if msg is not None:
            raise ValueError(msg)
    o, final, saved, _ = fwd(plan, q, k, v, g, beta, initial_state)
    return o, final, saved


def _check_grad_output(name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_backward_args(saved: GDNSaved, do: torch.Tensor, dht: torch.Tensor | None,
                        deterministic: bool) -> None:
    """Raise ``ValueError`` if ``saved`` is not a :class:`GDNSaved` of this mode or
    ``do``/``dht`` do not fit it (``TypeError`` for a non-tensor)."""
    if not isinstance(saved, GDNSaved):
        raise ValueError(f"saved must be a GDNSaved, got {type(saved).__name__}")
    if saved.deterministic != deterministic:
        raise ValueError(
            f"saved set was produced with deterministic={saved.deterministic}, "
            f"but the backward was asked for deterministic={deterministic}"
        )
    s = saved.shapes
    _check_grad_output("do", do, (s.B, s.T, s.HV, s.V), saved.device)
    if dht is not None:
        _check_grad_output("dht", dht, (s.num_docs, s.HV, s.K, s.V), saved.device)


def chunk_gdn_bwd(
    saved: GDNSaved,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    *,
    deterministic: bool,
    workspace: object | None = None,
) -> GDNGrads:
    """Chunked GDN backward of :func:`chunk_gdn_fwd`.

    ``do: [B,T,HV,V]``, ``dht: [N,HV,K,V]`` (gradient of the final state) or
    ``None``. ``workspace``: a :class:`gdn_core.ops.backward.BackwardWorkspace`
    (triton backend) reused across steps, or ``None`` to allocate.

    Raises ``ValueError`` if ``saved`` is not a :class:`GDNSaved`, was made in
    the other mode (``deterministic`` differs), or ``do``/``dht`` do not fit.
    """
    check_backward_args(saved, do, dht, deterministic)
    return bwd(saved, None, do, dht, workspace=workspace)[0]
