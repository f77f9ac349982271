"""torch.compile(fullgraph=True) of a small GDN block: short conv → GDN → projection.

The public calls route through the package's custom ops
(``torch.ops.gdn_det_train.*``), so Dynamo traces the block without a graph
break and AOTAutograd differentiates through the registered backward. On the
CPU reference backend (and, in a subprocess, the Triton interpreter) the
compiled block must give eager's bits, for several document layouts and
without recompiling per layout.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.suites.single_rank_compile import *  # noqa: F403 - the shared tests, on this package
from gdn_core.suites.single_rank_compile import HV, H, K, T, V, make_params, no_graph_breaks
from gdn_det_train import VarlenLayout, chunk_gated_delta_rule_det


def test_segments_through_the_op():
    # documents longer than segment_size run gdn_core.segment's path inside the op
    from gdn_core.autograd import chunk_gdn_autograd

    p = make_params(6)
    q, k = p["x"][..., :K].reshape(1, T, H, K), p["x"][..., K:2 * K].reshape(1, T, H, K)
    v = p["x"][..., 2 * K:].reshape(1, T, HV, V)
    cu = torch.tensor([0, 5, 96])

    def gdn(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, p["g"], p["beta"])]
        o, ht = fn(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                   output_final_state=True, **kw)
        ((o * o).sum() + ht.sum()).backward()
        return [o.detach(), ht.detach()] + [t.grad for t in leaves]

    def seg(*a, **kw):
        return chunk_gated_delta_rule_det(*a, segment_size=64, **kw)

    want = gdn(chunk_gdn_autograd, deterministic=True, segment_size=64)
    assert all(torch.equal(a, b) for a, b in zip(gdn(seg), want))
    compiled = torch.compile(seg, fullgraph=True, backend="aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(gdn(compiled), want))
    no_graph_breaks()
    with pytest.raises(ValueError, match="segment_size"):
        chunk_gated_delta_rule_det(q, k, v, p["g"], p["beta"],
                                   cu_seqlens=VarlenLayout([0, 5, 96]), segment_size=64)
