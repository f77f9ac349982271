"""The host plan of one GDN call: every decision that is not a tensor's value, made once.

:func:`make_plan` validates a call's arguments (every documented check, in one
place: :func:`~gdn_core.validation.validate_gdn_inputs`, the gate parameters,
``segment_size``, the backend) and returns a :class:`GDNPlan`: the sizes, the
documents, the segment layout, the chunk table on the device, the backend and
the mode. Plans are cached (a bounded LRU) on a key made of the arguments'
metadata — shapes, dtypes, devices, the document offsets, the flags and the
backend environment — so a call whose key was seen before skips validation
altogether: it would pass every check again. The forward and backward custom
ops find the plan of their public call by the same key.

Backends (chosen here, once; the composition's callers never branch on it):

* ``"triton"`` — the kernels of :mod:`gdn_core.ops`; CUDA tensors, and CPU
  tensors when ``TRITON_INTERPRET=1`` (Triton's interpreter).
* ``"reference"`` — the fp32 torch reference (:mod:`gdn_core.reference`,
  backward by autograd); CPU tensors otherwise, and float64 (``gradcheck``).

``GDN_CORE_BACKEND=triton|reference`` in the environment overrides the choice.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from gdn_core.chunking import ChunkIndex, chunk_index
from gdn_core.gate import validate_gate_params
from gdn_core.hostcache import capturing, tensor_values
from gdn_core.segment import SegmentLayout, choose_segment_size, resolve_segment_size
from gdn_core.switches import env_value
from gdn_core.validation import GDNShapes, validate_gdn_inputs

__all__ = ["BACKENDS", "GDNPlan", "make_plan", "resolve_backend", "saved_state_rows"]

BACKENDS = ("triton", "reference")
_INT_DTYPES = (torch.int32, torch.int64)


def resolve_backend(device: torch.device, dtype: torch.dtype, backend: str | None = None) -> str:
    """The backend that runs tensors on ``device`` (see the module docstring).

    Raises:
        ValueError: an unknown ``backend``, or ``"triton"`` for CPU tensors
            without ``TRITON_INTERPRET=1``.
        TypeError: float64 inputs on the triton backend.
    """
    backend = backend or env_value("GDN_CORE_BACKEND") or None
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    elif device.type == "cuda" or env_value("TRITON_INTERPRET") == "1":
        backend = "triton"
    else:
        backend = "reference"
    if backend == "triton" and dtype == torch.float64:
        raise TypeError("float64 inputs run only on the reference backend (backend='reference')")
    if backend == "triton" and device.type != "cuda" and env_value("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the triton backend needs CUDA tensors or TRITON_INTERPRET=1, got device {device}"
        )
    return backend


def saved_state_rows(num_docs: int, T: int, tokens: int, segment_size: int | None) -> int:
    """Rows of the segment entry states / summaries a forward op returns: an upper
    bound of the segment count that depends on the shapes only, so a fake
    implementation knows it without the offsets. ``num_docs`` documents of at
    most ``T`` tokens each (``q.shape[1]``), ``tokens`` in all; ``segment_size`` as
    given to the call (``None``: the default size bounds both choices
    :func:`~gdn_core.segment.choose_segment_size` can make). ``0`` when no
    document can be longer than one segment."""
    S = resolve_segment_size(segment_size)
    return 0 if not S or T <= S else num_docs + tokens // S


@dataclass(frozen=True, eq=False)
class GDNPlan:
    """One call's validated host state (see the module docstring). Read-only, shared
    by every call with the same key.

    Attributes:
        shapes: the validated sizes and host document offsets.
        deterministic: the mode (pinned configs and ordered reductions).
        backend: ``"triton"`` or ``"reference"``.
        scale: the output scale (``K ** -0.5`` unless given).
        use_qk_l2norm_in_kernel, use_gate_in_kernel, output_final_state,
        has_initial_state: the call's flags.
        segments: the :class:`~gdn_core.segment.SegmentLayout` (trivial: one
            segment per document, the plain chunked recurrence).
        index: the chunk table on the device (triton; the layout's padded one
            for a :class:`~gdn_core.layout.VarlenLayout`), else ``None``.
        state_rows: rows of the op's saved-state outputs (:func:`saved_state_rows`).
        cu_host: the offsets as a CPU int64 tensor (what the custom ops receive).
    """

    shapes: GDNShapes
    deterministic: bool
    backend: str
    scale: float
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    output_final_state: bool
    has_initial_state: bool
    segments: SegmentLayout
    index: ChunkIndex | None
    state_rows: int
    cu_host: torch.Tensor | None


#: Plans kept (least recently used dropped): a run alternates between a handful of
#: layouts and shapes per layer. An ``OrderedDict`` read and written in C: the
#: lookup on a hit is one dictionary access, no Python call.
PLAN_CACHE_SIZE = 64
_PLANS: OrderedDict[Any, GDNPlan] = OrderedDict()




def make_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    deterministic: bool,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    backend: str | None = None,
    segment_size: int | None = None,
    index: ChunkIndex | None = None,
) -> GDNPlan:
    """The :class:`GDNPlan` of a call with these arguments (cached; validated on a miss).

    ``index``: a prebuilt chunk table of the documents (e.g. a
    :class:`~gdn_core.layout.PaddedChunkIndex`, or a KCP context's), used when
    the layout has no segments (``cu_seqlens`` defaults to its offsets). Its
    identity is part of the key (a cached plan holds the table it was made with).

    Raises:
        TypeError, ValueError: as :func:`~gdn_core.validation.validate_gdn_inputs`,
            :func:`~gdn_core.gate.validate_gate_params`,
            :func:`~gdn_core.segment.resolve_segment_size` and
            :func:`resolve_backend` document.
    """
    for name, flag in (("output_final_state", output_final_state),
                       ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)):
        if not isinstance(flag, bool):  # "no" would switch the option on
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    offsets = None
    try:
        if isinstance(cu_seqlens, torch.Tensor):  # the dtype, rank and device count too
            offsets = (cu_seqlens.dtype in _INT_DTYPES, cu_seqlens.dim(), cu_seqlens.device,
                       tensor_values(cu_seqlens))
        elif cu_seqlens is not None:  # the entries' types too: [0, 3.0, 8] is not [0, 3, 8]
            offsets = (True, 1, tuple(cu_seqlens), tuple(map(type, cu_seqlens)))
        key = (
            q.shape, q.dtype, q.device, k.shape, k.dtype, k.device, v.shape, v.dtype, v.device,
            g.shape, g.dtype, g.device, beta.shape, beta.dtype, beta.device,
            None if initial_state is None else
            (initial_state.shape, initial_state.dtype, initial_state.device),
            None if A_log is None else (A_log.shape, A_log.dtype, A_log.device),
            None if dt_bias is None else (dt_bias.shape, dt_bias.dtype, dt_bias.device),
            offsets, None if index is None else id(index), type(scale), scale,
            bool(output_final_state), bool(use_qk_l2norm_in_kernel), type(use_gate_in_kernel),
            use_gate_in_kernel, bool(deterministic), backend, type(segment_size), segment_size,
            env_value("GDN_CORE_BACKEND"), env_value("TRITON_INTERPRET"),
        )
        hash(key)
    except (AttributeError, TypeError, NotImplementedError, RuntimeError):
        # not tensors, unhashable offsets, a meta cu_seqlens: validation says why
        key = None
    if key is not None:
        got = _PLANS.get(key)
        if got is not None:
            try:
                _PLANS.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile: still a valid plan
                pass
            return got
    plan = _build(q, k, v, g, beta, deterministic=bool(deterministic), scale=scale,
                  initial_state=initial_state, output_final_state=bool(output_final_state),
                  cu_seqlens=cu_seqlens, l2=bool(use_qk_l2norm_in_kernel),
                  gate=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, backend=backend,
                  segment_size=segment_size, index=index)
    if key is not None and not capturing(q.device):
        _PLANS[key] = plan
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def _build(q, k, v, g, beta, *, deterministic, scale, initial_state, output_final_state,
           cu_seqlens, l2, gate, A_log, dt_bias, backend, segment_size, index) -> GDNPlan:
    """Every check of a call, then its plan."""
    if index is not None and cu_seqlens is None:
        cu_seqlens = list(index.offsets)
    shapes = validate_gdn_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 cu_seqlens=cu_seqlens, allow_float64=True)
    if not isinstance(gate, bool):
        raise TypeError(f"use_gate_in_kernel must be a bool, got {type(gate).__name__}")
    if gate:
        validate_gate_params(g, A_log, dt_bias, shapes.HV)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are used only with use_gate_in_kernel=True")
    S = choose_segment_size(segment_size, shapes.offsets, shapes.HV, deterministic=deterministic)
    chosen = resolve_backend(q.device, q.dtype, backend)
    has_h0 = initial_state is not None
    segments = SegmentLayout.build(shapes.offsets, S, has_h0=has_h0)
    if chosen != "triton":
        index = None
    elif not segments.trivial:
        index = segments.index(q.device)
    elif index is None or index.offsets != shapes.offsets:
        index = chunk_index(shapes.offsets, q.device)
    cu_host = None if cu_seqlens is None else torch.tensor(shapes.offsets, dtype=torch.int64)
    return GDNPlan(
        shapes=shapes, deterministic=deterministic, backend=chosen,
        scale=float(shapes.K**-0.5 if scale is None else scale), use_qk_l2norm_in_kernel=l2,
        use_gate_in_kernel=gate, output_final_state=output_final_state,
        has_initial_state=has_h0, segments=segments, index=index,
        state_rows=saved_state_rows(shapes.num_docs, shapes.T, shapes.B * shapes.T,
                                    segment_size),
        cu_host=cu_host,
    )
