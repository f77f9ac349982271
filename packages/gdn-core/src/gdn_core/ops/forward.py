"""The composed GDN forward pass on the flat token axis (Triton kernels).

``l2norm (optional) → chunk_cumsum_fwd → wy_fwd → chunk_state_fwd →
chunk_output_fwd``. Returns only what the backward needs beyond the inputs:
``A_inv`` as the backward reads it; the backward recomputes ``W``, ``U`` from
it and the chunk states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.ops import gluon
from gdn_core.ops.chunk_state import chunk_state_fwd
from gdn_core.ops.cumsum import chunk_cumsum_fwd
from gdn_core.ops.l2norm import l2norm_fwd_pair
from gdn_core.ops.output import chunk_output_fwd
from gdn_core.ops.wy import wy_fwd

__all__ = ["ForwardTensors", "gdn_forward_triton"]


@dataclass
class ForwardTensors:
    """Outputs of :func:`gdn_forward_triton`.

    Attributes:
        o: ``[T, HV, V]`` in q's dtype.
        final_state: ``[N, HV, K, V]`` fp32, or ``None``.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g``.
        q_used, k_used: ``[T, H, K]`` the q/k the kernels consumed (normalised
            when ``use_qk_l2norm_in_kernel``, else the inputs themselves).
        q_rstd, k_rstd: ``[T, H]`` fp32 inverse norms, or ``None`` without l2norm.
        A_inv: ``[T, HV, 64]`` (:func:`~gdn_core.ops.wy.inverse_for_backward`).
    """

    o: torch.Tensor
    final_state: torch.Tensor | None
    G: torch.Tensor
    q_used: torch.Tensor
    k_used: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None
    A_inv: torch.Tensor | None = None


def gdn_forward_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    index: ChunkIndex,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
) -> ForwardTensors:
    """Chunked GDN forward.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; g, beta: ``[T, HV]`` with
            ``HV`` a multiple of ``H`` (flat token axis, documents via ``index``).
            bf16/fp16/fp32; ``g`` (log-decay, ≤ 0) any float dtype.
        scale: output scale; ``None`` → ``K ** -0.5``.
        index: chunk table (:meth:`ChunkIndex.build`) of the token axis.
        initial_state: ``[N, HV, K, V]`` (fp32) or ``None``.
        output_final_state: also return the state after each document.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.

    Returns:
        :class:`ForwardTensors`.
    """
    T, H, K = q.shape
    HV = v.shape[1]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H}")
    group = HV // H
    if scale is None:
        scale = K**-0.5
    if use_qk_l2norm_in_kernel:
        (q_used, q_rstd), (k_used, k_rstd) = l2norm_fwd_pair(q, k)  # one launch
    else:
        q_used, k_used, q_rstd, k_rstd = q, k, None, None
    G = chunk_cumsum_fwd(g, index)
    A_inv, W, U = gluon.pick("wy", wy_fwd, k_used, v, index)(k_used, v, beta, G, index, group,
                                                             A_inv_for_backward=True)
    h, v_new, final = gluon.pick("state", chunk_state_fwd, k_used, W, U, index)(
        k_used, W, U, G, index, group, initial_state=initial_state,
        output_final_state=output_final_state, store_states=True,
    )
    del W, U  # spent before the output kernel allocates o (a lower forward peak)
    output = gluon.pick("output", chunk_output_fwd, q_used, v_new, h, index)
    o = output(q_used, k_used, v_new, h, G, scale, index, group)
    return ForwardTensors(o, final, G, q_used, k_used, q_rstd, k_rstd, A_inv)
