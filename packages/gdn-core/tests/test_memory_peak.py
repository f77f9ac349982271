"""Peak extra memory of one forward+backward (Triton kernels; the interpreter on CPU).

Counted with :class:`gdn_core.testkit.LiveBytes` in units of one ``[T, HV, D]``
16-bit tensor. The bounds hold the figures of 2026-11-30 (plain 10.2, segments
13.4 at this shape; 17.3 and 19.1 before this session's memory work, fla's
kernels take 14.6 at B1 T32768 on the H200): a change that keeps one more
``[T, HV, D]`` buffer alive at the peak fails here.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.testkit import LiveBytes, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("deterministic,segment_size,bound", [
    (False, 0, 10.5),   # the plain chunk recurrence
    (True, 256, 13.75),  # four segments per document, folded
])
def test_forward_backward_peak(deterministic, segment_size, bound):
    T, H, D = 1024, 2, 64
    inputs, _, cot = make_inputs(T=T, H=H, HV=H, K=D, V=D, dtype=torch.float16, device=DEVICE,
                                 initial_state=False)
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    do = cot["do"]
    with LiveBytes() as live:
        o, _, saved = chunk_gdn_fwd(q, k, v, g, beta, deterministic=deterministic,
                                    backend="triton", segment_size=segment_size)
        grads = chunk_gdn_bwd(saved, do, deterministic=deterministic)
        del saved
    unit = T * H * D * 2
    assert o.shape == v.shape and grads.dq.shape == q.shape
    assert live.peak / unit <= bound, f"peak {live.peak / unit:.2f} units > {bound}"
