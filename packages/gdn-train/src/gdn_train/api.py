"""Fast (non-deterministic) chunked Gated DeltaNet: autograd call and split forward/backward."""

from __future__ import annotations

from gdn_train.ops import API

__all__ = ["chunk_gated_delta_rule", "chunk_gdn_fwd", "chunk_gdn_bwd"]

chunk_gated_delta_rule = API.autograd_call(
    "chunk_gated_delta_rule",
    summary="Chunked GDN, differentiable, the fastest configuration (may use atomics).",
    mode="""they match the fp32 reference within tolerance but may differ in the last
    bits from run to run (atomics, autotuned configs).""",
    segments="""``segment_size`` (a multiple of 64, or 0 for none): documents longer than
    this run as fixed segments of that many tokens — summarised, folded, then
    run in parallel: faster for a few long documents, slower where the batch
    already fills the GPU. Default ``None``: segments of 4096 where they pay — a
    document longer than 8192 tokens, or enough segment programs for the fused
    reverse pass where the documents alone have too few
    (:func:`gdn_core.segment.choose_segment_size`) — else none. A
    :class:`~gdn_core.layout.VarlenLayout` runs without segments
    (``segment_size`` must be ``None`` or ``0``). Raises ``ValueError`` for any
    other value.""",
)
chunk_gdn_fwd = API.split_fwd("chunk_gdn_fwd", autograd="chunk_gated_delta_rule",
                              bwd="chunk_gdn_bwd")
chunk_gdn_bwd = API.split_bwd("chunk_gdn_bwd", fwd="chunk_gdn_fwd", other="gdn_det_train")
