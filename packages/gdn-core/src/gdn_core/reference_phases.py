"""The CPU path: the segment phases of :mod:`gdn_core.segment` on the fp32 torch reference.

When the plan chose the ``"reference"`` backend (CPU tensors without
``TRITON_INTERPRET=1``, float64, or ``GDN_CORE_BACKEND=reference``), each phase
of the composition hands its work to the function here of the same role:

* :func:`summaries` — phase 1's segment summaries ``[E | M]``;
* :func:`forward` — phase 3: every segment's recurrence and output;
* :func:`entry_state_grads` — the backward's first pass (each segment's own
  initial-state gradient);
* :func:`backward` — the full backward of every segment, by autograd.

Everything runs :mod:`gdn_core.reference` (fp32, fp64 for fp64 inputs) over the
segment-level documents; the fold between the phases is the same fixed-order
fold as on the kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gdn_core.reference import (
    _prepare,
    chunk_cumsum_ref,
    chunk_gdn_reference,
    chunk_states_ref,
    wy_ref,
)
from gdn_core.saved import GDNSaved

if TYPE_CHECKING:
    from gdn_core.segment import SegmentForward

__all__ = ["backward", "entry_state_grads", "forward", "summaries"]


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _as_packed(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grad(outs: list, grads: list, wrt: list) -> list:
    """``torch.autograd.grad(outs, wrt, grads)``, zeros for an input nothing depends on.
    Outputs outside the graph are left out (``T = 0`` or ``B = 0``: an empty ``o``
    made without the inputs), and the output gradients are made contiguous: autograd
    takes other paths for other strides, and the bits must not depend on them."""
    pairs = [(o, g.contiguous()) for o, g in zip(outs, grads) if o.requires_grad]
    got = [None] * len(wrt)
    if pairs:
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True)
    return [torch.zeros_like(w) if d is None else d for d, w in zip(got, wrt)]


def summaries(st: SegmentForward) -> torch.Tensor:
    """``[nseg, HV, K, V+K]`` summaries ``[E | M]`` of every segment (phase 1)."""
    L = st.layout
    q, k, v, g, beta = (_as_packed(x) for x in st.inputs)
    _, k, v, g, beta, _ = _prepare(q, k, v, g, beta, st.scale, st.l2)
    k, v, g, beta = _flat(k), _flat(v), _flat(g), _flat(beta)
    T, HV, K = k.shape
    bounds = list(zip(L.seg_offsets[:-1], L.seg_offsets[1:]))
    G = chunk_cumsum_ref(g, bounds)
    _, W, U = wy_ref(k, v, beta, G, bounds)
    Uz = torch.cat([U, U.new_zeros(T, HV, K)], dim=-1)
    init = k.new_zeros(L.num_segments, HV, K, U.shape[-1] + K)
    init[..., U.shape[-1]:] = torch.eye(K, dtype=k.dtype, device=k.device)
    _, _, summ = chunk_states_ref(k, W, Uz, G, bounds, init)
    return summ


def forward(st: SegmentForward, init: torch.Tensor | None, output_final_state: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None, GDNSaved]:
    """Phase 3 from the segments' entry states ``init``: ``(o, every segment's final
    state or None, saved)``."""
    L, s = st.layout, st.shapes
    q, k, v, g, beta = st.inputs
    with torch.no_grad():
        o, fin = chunk_gdn_reference(
            _as_packed(q), _as_packed(k), _as_packed(v), _as_packed(g), _as_packed(beta),
            scale=st.scale, initial_state=init, output_final_state=output_final_state,
            cu_seqlens=list(L.seg_offsets), use_qk_l2norm_in_kernel=st.l2,
        )
    o = o.reshape(s.B, s.T, s.HV, s.V).to(v.dtype)
    saved = GDNSaved(st.deterministic, "reference", s, st.scale, st.l2, q, k, v, g, beta,
                     st.initial_state, segments=None if L.trivial else L, seg_states=st.S_in,
                     seg_summ=st.summ)
    return o, fin, saved


def entry_state_grads(saved: GDNSaved, do, init, D0) -> torch.Tensor:
    """The gradient w.r.t. every segment's entry state ``init``, with ``D0`` the
    gradient of each segment's final state (the backward's first pass)."""
    L = saved.segments
    ins = [_as_packed(x).detach() for x in (saved.q, saved.k, saved.v, saved.g, saved.beta)]
    h0 = init.detach().requires_grad_(True)
    with torch.enable_grad():
        o, fin = chunk_gdn_reference(
            *ins, scale=saved.scale, initial_state=h0, output_final_state=D0 is not None,
            cu_seqlens=list(L.seg_offsets), use_qk_l2norm_in_kernel=saved.use_qk_l2norm_in_kernel,
        )
        outs, grads = [o], [_as_packed(do).to(o.dtype)]
        if D0 is not None:
            outs.append(fin)
            grads.append(D0.to(fin.dtype))
        (dh0,) = _grad(outs, grads, [h0])
    return dh0.to(_state_dtype(saved.q.dtype))


def backward(saved: GDNSaved, do, dht, init):
    """Autograd through the fp32 chunked reference over the segments: ``(dq, dk, dv,
    dg, dbeta, dh0)`` (``dh0`` per segment, or ``None`` without entry states)."""
    L = saved.segments
    leaves = [x.detach().requires_grad_(True)
              for x in (saved.q, saved.k, saved.v, saved.g, saved.beta)]
    h0 = None if init is None else init.detach().requires_grad_(True)
    with torch.enable_grad():
        o, final = chunk_gdn_reference(
            *(_as_packed(x) for x in leaves), scale=saved.scale, initial_state=h0,
            output_final_state=dht is not None,
            cu_seqlens=list(saved.shapes.offsets if L is None else L.seg_offsets),
            use_qk_l2norm_in_kernel=saved.use_qk_l2norm_in_kernel,
        )
        outs, grads = [o], [_as_packed(do).to(o.dtype)]
        if dht is not None:
            outs.append(final)
            grads.append(dht.to(final.dtype))
        wrt = leaves + ([h0] if h0 is not None else [])
        got = _grad(outs, grads, wrt)
    dq, dk, dv, dg, dbeta = (d.to(x.dtype) for d, x in zip(got[:5], leaves))
    dh0 = got[5].to(_state_dtype(saved.q.dtype)) if h0 is not None else None
    return dq, dk, dv, dg, dbeta, dh0
