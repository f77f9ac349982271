"""Fast (non-deterministic) chunked Gated DeltaNet: autograd call and split forward/backward."""

from __future__ import annotations

import torch
from gdn_core.autograd import train_bwd, train_fwd
from gdn_core.layout import VarlenLayout
from gdn_core.typed import require_instance

from gdn_train._typed import Grads, SavedSet, Workspace
from gdn_train.ops import OPS

__all__ = ["chunk_gated_delta_rule", "chunk_gdn_fwd", "chunk_gdn_bwd"]


def chunk_gated_delta_rule(
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
    workspace: Workspace | None = None,
    segment_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked GDN, differentiable, the fastest configuration (may use atomics).

    Shapes: ``q, k: [B,T,H,K]``, ``v: [B,T,HV,V]`` (``HV`` a multiple of ``H``),
    ``g, beta: [B,T,HV]``, ``initial_state: [N,HV,K,V]``, ``cu_seqlens: [N+1]``
    (packed documents, ``B == 1``; a list, a tensor — a CPU one under
    ``torch.compile`` — or a :class:`gdn_core.layout.VarlenLayout` with
    fixed-size device tables for CUDA graphs). ``g`` is the log-decay, or with
    ``use_gate_in_kernel=True`` the raw gate input, turned into
    ``−exp(A_log)·softplus(g + dt_bias)`` (``A_log, dt_bias: [HV]``) inside.

    Returns ``(o [B,T,HV,V], final_state [N,HV,K,V] fp32 or None)``. Gradients
    flow to ``q, k, v, g, beta, initial_state`` (and ``A_log, dt_bias``);
    they match the fp32 reference within tolerance but may differ in the last
    bits from run to run (atomics, autotuned configs). ``workspace``: a
    :class:`Workspace` the backward reuses.

    ``segment_size`` (a multiple of 64, or 0 for none): documents longer than
    this run as fixed segments of that many tokens — summarised, folded, then
    run in parallel: faster for a few long documents, slower where the batch
    already fills the GPU. Default ``None``: segments of 4096 only while fewer
    than 32 (document, value head) pairs have a document longer than 4096
    tokens (:func:`gdn_core.segment.choose_segment_size`), else none. A
    :class:`~gdn_core.layout.VarlenLayout` runs without segments
    (``segment_size`` must be ``None`` or ``0``). Raises ``ValueError`` for any
    other value.
    """
    if workspace is not None:
        require_instance(workspace, Workspace, "workspace")
    return OPS.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, workspace=workspace, segment_size=segment_size,
    )


def chunk_gdn_fwd(
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
) -> tuple[torch.Tensor, torch.Tensor | None, SavedSet]:
    """Forward of the split API: ``(o, final_state, saved)``.

    Same arguments as :func:`chunk_gated_delta_rule`; no autograd graph is
    recorded. Pass ``saved`` to :func:`chunk_gdn_bwd`.
    """
    with torch.no_grad():
        return train_fwd(
            SavedSet, q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            segment_size=segment_size,
        )


def chunk_gdn_bwd(
    saved: SavedSet,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    workspace: Workspace | None = None,
) -> Grads:
    """Backward of the split API.

    ``saved``: the :class:`SavedSet` of :func:`chunk_gdn_fwd`; ``do``:
    gradient of ``o``; ``dht``: gradient of the final state or ``None``;
    ``workspace``: a :class:`Workspace` (reused across steps) or ``None``.

    Raises ``ValueError`` — before touching any tensor — if ``saved`` is not a
    ``SavedSet`` or ``workspace`` not a ``Workspace`` (e.g. made by
    ``gdn_det_train``), or the workspace is too small or on another device.
    """
    require_instance(saved, SavedSet, "saved")
    if workspace is not None:
        require_instance(workspace, Workspace, "workspace")
    with torch.no_grad():
        return train_bwd(saved, do, dht, workspace=workspace, grads_cls=Grads)
