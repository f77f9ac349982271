"""Deterministic chunked Gated DeltaNet: autograd call and split forward/backward."""

from __future__ import annotations

from gdn_det_train.ops import API

__all__ = ["chunk_gated_delta_rule_det", "chunk_gdn_det_fwd", "chunk_gdn_det_bwd"]

chunk_gated_delta_rule_det = API.autograd_call(
    "chunk_gated_delta_rule_det",
    summary="Chunked GDN, differentiable, with bitwise-deterministic gradients.",
    mode="repeated calls and other processes give identical bits.",
    segments="""``segment_size`` (default 4096; a multiple of 64, or 0 for none): documents
    longer than this run as fixed segments of that many tokens — summarised,
    folded in a fixed fp32 order, then run in parallel (the speed-up for long
    documents). The bits depend on it: ``gdn_det_train_kcp`` with
    ``partition_det_kcp(..., boundary="segment", segment_size=S)`` gives these
    very bits for any number of ranks. A :class:`~gdn_core.layout.VarlenLayout`
    runs without segments (``segment_size`` must be ``None`` or ``0``).""",
)
chunk_gdn_det_fwd = API.split_fwd("chunk_gdn_det_fwd", autograd="chunk_gated_delta_rule_det",
                                  bwd="chunk_gdn_det_bwd")
chunk_gdn_det_bwd = API.split_bwd("chunk_gdn_det_bwd", fwd="chunk_gdn_det_fwd",
                                  other="gdn_train")
