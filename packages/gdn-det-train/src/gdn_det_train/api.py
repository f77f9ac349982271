"""Deterministic chunked Gated DeltaNet: autograd call and split forward/backward."""

from __future__ import annotations

import torch
from gdn_core.autograd import train_bwd, train_fwd
from gdn_core.layout import VarlenLayout
from gdn_core.typed import require_instance

from gdn_det_train._typed import DetGrads, DetSavedSet, DetWorkspace
from gdn_det_train.ops import OPS

__all__ = ["chunk_gated_delta_rule_det", "chunk_gdn_det_fwd", "chunk_gdn_det_bwd"]


def chunk_gated_delta_rule_det(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | list[int] | VarlenLayout | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    workspace: DetWorkspace | None = None,
    segment_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked GDN, differentiable, with bitwise-deterministic gradients.

    Shapes: ``q, k: [B,T,H,K]``, ``v: [B,T,HV,V]`` (``HV`` a multiple of ``H``),
    ``g, beta: [B,T,HV]``, ``initial_state: [N,HV,K,V]``, ``cu_seqlens: [N+1]``
    (packed documents, ``B == 1``; a list, a tensor — a CPU one under
    ``torch.compile`` — or a :class:`gdn_core.layout.VarlenLayout` with
    fixed-size device tables for CUDA graphs). ``g`` is the log-decay, or with
    ``use_gate_in_kernel=True`` the raw gate input, turned into
    ``−exp(A_log)·softplus(g + dt_bias)`` (``A_log, dt_bias: [HV]``) inside.

    Returns ``(o [B,T,HV,V], final_state [N,HV,K,V] fp32 or None)``. Gradients
    flow to ``q, k, v, g, beta, initial_state`` (and ``A_log, dt_bias``);
    repeated calls and other processes give identical bits. ``workspace``: a
    :class:`DetWorkspace` the backward reuses.

    ``segment_size`` (default 4096; a multiple of 64, or 0 for none): documents
    longer than this run as fixed segments of that many tokens — summarised,
    folded in a fixed fp32 order, then run in parallel (the speed-up for long
    documents). The bits depend on it: ``gdn_det_train_kcp`` with
    ``partition_det_kcp(..., boundary="segment", segment_size=S)`` gives these
    very bits for any number of ranks. A :class:`~gdn_core.layout.VarlenLayout`
    runs without segments (``segment_size`` must be ``None`` or ``0``).

    Traced by ``torch.compile(fullgraph=True)`` without a graph break: it runs
    the custom op ``torch.ops.gdn_det_train.chunk_gated_delta_rule`` (see
    :mod:`gdn_core.train_ops`).
    """
    if workspace is not None:
        require_instance(workspace, DetWorkspace, "workspace")
    return OPS.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, workspace=workspace, segment_size=segment_size,
    )


def chunk_gdn_det_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    segment_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, DetSavedSet]:
    """Forward of the split API: ``(o, final_state, saved)``.

    Same arguments as :func:`chunk_gated_delta_rule_det`; no autograd graph is
    recorded. Pass ``saved`` to :func:`chunk_gdn_det_bwd`.
    """
    with torch.no_grad():
        return train_fwd(
            DetSavedSet, q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            segment_size=segment_size,
        )


def chunk_gdn_det_bwd(
    saved: DetSavedSet,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    workspace: DetWorkspace | None = None,
) -> DetGrads:
    """Backward of the split API.

    ``saved``: the :class:`DetSavedSet` of :func:`chunk_gdn_det_fwd`; ``do``:
    gradient of ``o``; ``dht``: gradient of the final state or ``None``;
    ``workspace``: a :class:`DetWorkspace` (reused across steps) or ``None``.

    Raises ``ValueError`` — before touching any tensor — if ``saved`` is not a
    ``DetSavedSet`` or ``workspace`` not a ``DetWorkspace`` (e.g. made by
    ``gdn_train``), or the workspace is too small or on another device.
    """
    require_instance(saved, DetSavedSet, "saved")
    if workspace is not None:
        require_instance(workspace, DetWorkspace, "workspace")
    with torch.no_grad():
        return train_bwd(saved, do, dht, workspace=workspace, grads_cls=DetGrads)
