"""What a GDN forward keeps for its backward, and what the backward returns.

:class:`GDNSaved` (the composition's saved set, mode-tagged), :class:`GateSaved`
(the in-kernel gate's inputs) and :class:`GDNGrads`. Plain data: made by
:func:`gdn_core.compose.fwd` and the segment phases (:mod:`gdn_core.segment`),
read by the backward; the custom ops carry their tensors as outputs and
arguments (:mod:`gdn_core.train_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.validation import GDNShapes

__all__ = ["GDNGrads", "GDNSaved", "GateSaved", "graph_is_released"]


@dataclass
class GDNSaved:
    """What :func:`chunk_gdn_bwd` needs from the forward (mode-tagged).

    ``q``/``k`` are the tensors the recurrence used: L2-normalised when
    ``use_qk_l2norm_in_kernel`` (then ``q_rstd``/``k_rstd`` hold the inverse
    norms for the normalisation's backward); ``G`` is the within-chunk
    cumulative sum of ``g`` (triton backend only; recomputed otherwise).
    With segments, ``segments`` is the :class:`gdn_core.segment.SegmentLayout`
    (``index`` then holds segments), ``seg_states`` every segment's entry
    state ``[nseg,HV,K,V]`` and ``seg_summ`` the summaries ``[E | M]``
    ``[nseg,HV,K,V+K]`` (fp32; fp64 for fp64 inputs) the backward fold reads.
    ``A_inv``: the forward's ``(I + A)^{-1}`` per chunk ``[T,HV,64]`` as the
    backward reads it (:func:`gdn_core.ops.wy.inverse_for_backward`; triton
    backend), so the backward skips the inverse; ``None``: recomputed.
    """

    deterministic: bool
    backend: str
    shapes: GDNShapes
    scale: float
    use_qk_l2norm_in_kernel: bool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    index: ChunkIndex | None = None
    G: torch.Tensor | None = None
    q_rstd: torch.Tensor | None = None
    k_rstd: torch.Tensor | None = None
    segments: Any = None
    seg_states: torch.Tensor | None = None
    seg_summ: torch.Tensor | None = None
    A_inv: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.v.device


@dataclass
class GDNGrads:
    """Gradients of one GDN call: ``dq, dk: [B,T,H,K]``, ``dv: [B,T,HV,V]``,
    ``dg, dbeta: [B,T,HV]`` in their inputs' dtypes, ``dh0: [N,HV,K,V]`` fp32
    (``None`` when the forward had no ``initial_state``)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None


@dataclass
class GateSaved:
    """The in-kernel gate's inputs (the gate output is recomputed in the backward)."""

    g_raw: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor


# Their documented home (and the name errors print) is the composition's module.
for _cls in (GDNSaved, GDNGrads):
    _cls.__module__ = "gdn_core.compose"


# ------------------------------------------------------ eager saved objects --

#: torch's own test (AOTAutograd releases its saved state with it); None on a torch without
_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def graph_is_released() -> bool:
    """Whether the backward running now frees its graph (no ``retain_graph``, no
    ``create_graph``): called inside an ``autograd.Function.backward``.

    An ``autograd.Function`` that keeps a Python saved set as a ``ctx`` attribute keeps
    it for as long as its graph node lives: past the backward, while the caller still
    holds the output (a training loop's ``loss`` of the previous step, a logged output),
    so that step's intermediates overlap the next step's, and a KCP context holds its
    process group into interpreter finalisation. Such a backward drops the attribute when
    this is true, as autograd then drops the saved tensors beside it (a second backward
    raises autograd's own error before reading it); with ``retain_graph`` the set stays
    for the next backward. ``False`` on a torch that does not tell (the set then lives
    with the node, as before).
    """
    return _KEEP_GRAPH is not None and not _KEEP_GRAPH()
