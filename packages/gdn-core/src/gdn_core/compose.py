"""The composed chunked GDN forward and backward every training package calls.

:func:`chunk_gdn_fwd` validates the inputs, picks a backend and returns the
output, the final state and a :class:`GDNSaved` holding what the backward
needs; :func:`chunk_gdn_bwd` returns :class:`GDNGrads`.

Backends:

* ``"triton"`` — the kernels of :mod:`gdn_core.ops`; chosen for CUDA tensors
  and for CPU tensors when ``TRITON_INTERPRET=1`` (Triton's interpreter).
* ``"reference"`` — :func:`gdn_core.reference.chunk_gdn_reference` (fp32
  torch, backward by autograd); chosen for CPU tensors otherwise. Also the
  only backend for float64 (``gradcheck``).

``GDN_CORE_BACKEND=triton|reference`` in the environment overrides the choice.

Segments (:mod:`gdn_core.segment`): documents longer than ``segment_size``
tokens (default :data:`gdn_core.segment.DEFAULT_SEGMENT_SIZE`) run as fixed
segments — summaries, a fixed-order fp32 fold, then every segment's
recurrence in parallel — on both backends and in both modes. The result's
bits depend on ``segment_size`` (a deterministic run is repeatable for a fixed
one, and a context-parallel run of a ``"segment"`` plan with the same size
gives the same bits for any number of ranks). Layouts whose documents are all
at most one segment long run the plain chunked path unchanged. Without an
explicit size a non-deterministic call keeps the plain path when enough long
documents fill the GPU anyway (:func:`gdn_core.segment.choose_segment_size`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from gdn_core.chunking import ChunkIndex, chunk_index
from gdn_core.reference import chunk_gdn_reference
from gdn_core.validation import GDNShapes, validate_gdn_inputs

__all__ = ["GDNSaved", "GDNGrads", "chunk_gdn_fwd", "chunk_gdn_bwd", "resolve_backend"]

BACKENDS = ("triton", "reference")


def resolve_backend(device: torch.device, dtype: torch.dtype, backend: str | None = None) -> str:
    """The backend that runs tensors on ``device`` (see the module docstring)."""
    backend = backend or os.environ.get("GDN_CORE_BACKEND") or None
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    elif device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        backend = "triton"
    else:
        backend = "reference"
    if backend == "triton" and dtype == torch.float64:
        raise TypeError("float64 inputs run only on the reference backend (backend='reference')")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the triton backend needs CUDA tensors or TRITON_INTERPRET=1, got device {device}"
        )
    return backend


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


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


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
) -> tuple[torch.Tensor, torch.Tensor | None, GDNSaved]:
    """Chunked GDN forward.

    Shapes: ``q, k: [B,T,H,K]``; ``v: [B,T,HV,V]``; ``g, beta: [B,T,HV]``;
    ``initial_state: [N,HV,K,V]``; ``cu_seqlens: [N+1]`` (``B == 1``). ``index``
    may pass a prebuilt :class:`ChunkIndex` of the same layout (saves the host
    work and, for a CUDA ``cu_seqlens``, a synchronisation).

    ``segment_size``: the segment length (a multiple of 64; ``0``: no
    segments; ``None``: :func:`gdn_core.segment.choose_segment_size` picks) —
    see the module docstring.

    ``shapes``: what :func:`~gdn_core.validation.validate_gdn_inputs` returned
    for exactly these arguments, when the caller has already validated them
    (the input checks are then not repeated); ``None``: validate here.

    Returns ``(o [B,T,HV,V] in v's dtype, final_state [N,HV,K,V] fp32 or None,
    saved)``. Raises ``TypeError``/``ValueError`` for bad input (see
    :func:`gdn_core.validation.validate_gdn_inputs`).
    """
    from gdn_core.segment import SegmentLayout, choose_segment_size, segment_fwd

    if shapes is None:
        if index is not None and cu_seqlens is None:
            cu_seqlens = list(index.offsets)
        shapes = validate_gdn_inputs(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            allow_float64=True,
        )
    S = choose_segment_size(segment_size, shapes.offsets, shapes.HV,
                            deterministic=deterministic)
    chosen = resolve_backend(q.device, q.dtype, backend)
    scale = float(shapes.K**-0.5 if scale is None else scale)
    layout = SegmentLayout.build(shapes.offsets, S, has_h0=initial_state is not None)
    if not layout.trivial:
        return segment_fwd(
            q, k, v, g, beta, layout=layout, scale=scale,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, initial_state=initial_state,
            output_final_state=output_final_state, backend=chosen,
            deterministic=deterministic, shapes=shapes,
        )
    if chosen == "reference":
        with torch.no_grad():
            o, final = chunk_gdn_reference(
                q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=list(shapes.offsets),
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )
        saved = GDNSaved(
            deterministic, chosen, shapes, scale, use_qk_l2norm_in_kernel,
            q, k, v, g, beta, initial_state,
        )
        return o.to(v.dtype), final, saved

    from gdn_core.ops.forward import gdn_forward_triton

    if index is None or index.offsets != shapes.offsets:
        index = chunk_index(shapes.offsets, q.device)
    fwd = gdn_forward_triton(
        _flat(q), _flat(k), _flat(v), _flat(g), _flat(beta),
        scale=scale, index=index, initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    saved = GDNSaved(
        deterministic, chosen, shapes, scale, use_qk_l2norm_in_kernel,
        fwd.q_used, fwd.k_used, _flat(v), _flat(g), _flat(beta), initial_state,
        index=index, G=fwd.G, q_rstd=fwd.q_rstd, k_rstd=fwd.k_rstd, A_inv=fwd.A_inv,
    )
    o = fwd.o.reshape(shapes.B, shapes.T, shapes.HV, shapes.V)
    return o, fwd.final_state, saved


def _check_grad_output(name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def chunk_gdn_bwd(
    saved: GDNSaved,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    *,
    deterministic: bool,
    workspace: object | None = None,
) -> GDNGrads:
    """Chunked GDN backward.

    ``do: [B,T,HV,V]``, ``dht: [N,HV,K,V]`` (gradient of the final state) or
    ``None``. ``workspace``: a :class:`gdn_core.ops.backward.BackwardWorkspace`
    (triton backend) reused across steps, or ``None`` to allocate.

    Raises ``ValueError`` if ``saved`` is not a :class:`GDNSaved`, was made in
    the other mode (``deterministic`` differs), or ``do``/``dht`` do not fit.
    """
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

    if saved.segments is not None:
        from gdn_core.segment import segment_bwd

        return segment_bwd(saved, do, dht, deterministic=deterministic, workspace=workspace)
    if saved.backend == "reference":
        return _reference_backward(saved, do, dht)

    from gdn_core.ops.backward import gdn_backward_triton

    dq, dk, dv, dg, dbeta, dh0 = gdn_backward_triton(
        saved, _flat(do), dht, deterministic=deterministic, workspace=workspace
    )
    B, T = s.B, s.T
    return GDNGrads(
        dq=dq.reshape(B, T, s.H, s.K),
        dk=dk.reshape(B, T, s.H, s.K),
        dv=dv.reshape(B, T, s.HV, s.V),
        dg=dg.reshape(B, T, s.HV),
        dbeta=dbeta.reshape(B, T, s.HV),
        dh0=dh0 if saved.initial_state is not None else None,
    )


def _reference_backward(
    saved: GDNSaved, do: torch.Tensor, dht: torch.Tensor | None
) -> GDNGrads:
    """Backward of the reference backend: autograd through the fp32 chunked reference."""
    inputs = [x.detach().requires_grad_(True) for x in (saved.q, saved.k, saved.v, saved.g,
                                                        saved.beta)]
    h0 = saved.initial_state
    if h0 is not None:
        h0 = h0.detach().requires_grad_(True)
    with torch.enable_grad():
        o, final = chunk_gdn_reference(
            *inputs, scale=saved.scale, initial_state=h0, output_final_state=dht is not None,
            cu_seqlens=list(saved.shapes.offsets),
            use_qk_l2norm_in_kernel=saved.use_qk_l2norm_in_kernel,
        )
        outs, grads = [o], [do.to(o.dtype)]
        if dht is not None:
            outs.append(final)
            grads.append(dht.to(final.dtype))
        wrt = inputs + ([h0] if h0 is not None else [])
        got = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    got = [torch.zeros_like(w) if d is None else d for d, w in zip(got, wrt)]
    dq, dk, dv, dg, dbeta = (d.to(x.dtype) for d, x in zip(got[:5], inputs))
    state_dtype = torch.float64 if saved.q.dtype == torch.float64 else torch.float32
    dh0 = got[5].to(state_dtype) if h0 is not None else None
    return GDNGrads(dq, dk, dv, dg, dbeta, dh0)
