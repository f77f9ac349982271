"""Triton kernels of the chunked GDN forward (and shared pieces of the backward).

Stages, each a launcher in its own module (flat token axis, documents and
chunks of 64 tokens given by a :class:`gdn_core.chunking.ChunkIndex`):

1. :mod:`~gdn_core.ops.cumsum` — ``chunk_cumsum_fwd`` (within-chunk cumsum of
   ``g`` → ``G``) and ``chunk_cumsum_rev`` (its backward).
2. :mod:`~gdn_core.ops.l2norm` — ``l2norm_fwd`` / ``l2norm_bwd`` (in-kernel
   L2 normalisation of q and k; ``l2norm_fwd_pair`` / ``l2norm_bwd_pair``: both
   in one launch).
3. :mod:`~gdn_core.ops.wy` — ``wy_fwd``: ``A_inv = (I + A)^{-1}``, ``W``, ``U``;
   ``wy_apply``: ``W``, ``U`` from a stored ``A_inv``.
4. :mod:`~gdn_core.ops.chunk_state` — ``chunk_state_fwd``: states entering
   each chunk, ``v_new = U − W S``, final states.
5. :mod:`~gdn_core.ops.output` — ``chunk_output_fwd``: the chunk outputs.
6. :mod:`~gdn_core.ops.forward` — ``gdn_forward_triton``: the composed forward.

Every launcher is registered with :func:`gdn_core.ops.registry.launcher`;
none of the forward kernels uses atomics, and all launch configurations are
pinned (no autotuning), so the forward is deterministic.
"""

from gdn_core.ops.chunk_state import chunk_state_fwd
from gdn_core.ops.cumsum import chunk_cumsum_fwd, chunk_cumsum_rev
from gdn_core.ops.forward import ForwardTensors, gdn_forward_triton
from gdn_core.ops.l2norm import l2norm_bwd, l2norm_bwd_pair, l2norm_fwd, l2norm_fwd_pair
from gdn_core.ops.output import chunk_output_fwd
from gdn_core.ops.registry import launcher, record_launches, registered_launchers
from gdn_core.ops.wy import inverse_for_backward, wy_apply, wy_fwd

__all__ = [
    "ForwardTensors",
    "chunk_cumsum_fwd",
    "chunk_cumsum_rev",
    "chunk_output_fwd",
    "chunk_state_fwd",
    "gdn_forward_triton",
    "inverse_for_backward",
    "l2norm_bwd",
    "l2norm_bwd_pair",
    "l2norm_fwd",
    "l2norm_fwd_pair",
    "launcher",
    "record_launches",
    "registered_launchers",
    "wy_apply",
    "wy_fwd",
]
