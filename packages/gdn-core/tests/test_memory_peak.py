"""Peak extra memory of one forward+backward (Triton kernels; the interpreter on CPU).

Counted with :class:`gdn_core.testkit.LiveBytes` in units of one ``[T, HV, D]``
16-bit tensor. The bounds hold the figures of 2026-12-01 (session 10: the chunk-gradient
kernels, no ``dW`` and no fp32 ``dk`` partial in HBM) at this shape: plain 9.27, segments
11.14; with two value heads per q/k head 11.27 and 13.14 (the fp32 ``dq``/``dk`` partials
exist from the chunk-gradient stage on only). Before: 10.2, 12.1, 11.2, 13.1 (session 9);
segments 13.4 and 15.6 grouped
(2026-11-30), 17.3 / 19.1 before the memory work; fla's kernels take 14.6 at B1
T32768 H16 and 13.5 at HV32 on the H200. A change that keeps one more ``[T, HV, D]``
buffer alive at the peak fails here.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.testkit import LiveBytes, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("deterministic,segment_size,group,bound", [
    (False, 0, 1, 9.5),    # the plain chunk recurrence
    (True, 256, 1, 11.5),  # four segments per document, folded
    (False, 0, 2, 11.5),   # grouped value heads: fp32 dq/dk partials
    (True, 256, 2, 13.5),
])
def test_forward_backward_peak(deterministic, segment_size, group, bound):
    T, H, D = 1024, 2, 64
    inputs, _, cot = make_inputs(T=T, H=H, HV=H * group, K=D, V=D, dtype=torch.float16,
                                 device=DEVICE, initial_state=False)
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    do = cot["do"]
    with LiveBytes() as live:
        o, _, saved = chunk_gdn_fwd(q, k, v, g, beta, deterministic=deterministic,
                                    backend="triton", segment_size=segment_size)
        grads = chunk_gdn_bwd(saved, do, deterministic=deterministic)
        del saved
    unit = T * H * group * D * 2
    assert o.shape == v.shape and grads.dq.shape == q.shape
    assert live.peak / unit <= bound, f"peak {live.peak / unit:.2f} units > {bound}"
