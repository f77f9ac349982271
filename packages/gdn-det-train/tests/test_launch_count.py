"""The device work of one deterministic forward+backward: how many Triton launches and
device-work aten ops (fills, copies, casts, gathers) it takes, counted in a child
interpreter on the Triton path (``TRITON_INTERPRET=1``, routed as a CUDA call at
K = V = 128 16-bit takes it: the fused forward, the Triton fold) by
:func:`gdn_core.testkit.audit_fwd_bwd`. Small and medium calls are host-bound on the
H200 (a Triton launch ~20 µs of host time, a small torch op 5-10 µs): a launch or op
added to the step shows up here. ``benchmarks/launch_audit_cpu.py --verbose`` lists them.

The shape: one document of two segments (as B1 T8192 with the default segments of
4096 tokens), q/k L2-normalised in the kernel, initial state given, final state returned.
"""

from __future__ import annotations

import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json
    import gdn_det_train as det
    from gdn_core.testkit import audit_fwd_bwd

    out = {}
    for name, lengths in (("1doc", [128]), ("3docs", [128, 40, 70])):
        a = audit_fwd_bwd(det.chunk_gated_delta_rule_det, lengths, 64, h0=True, final=True,
                          H=1)
        out[name] = dict(a.counts(), listing=a.listing())
    print(json.dumps(out))
    """
)


def test_det_fwd_bwd_launch_count(run_script):
    (got,) = run_script(_SCRIPT, TRITON_INTERPRET="1", timeout=900)
    for name, c in got.items():
        listing = "\n".join(c["listing"])
        # 15 Triton launches (17 before q/k and dq/dk each shared one L2-norm launch):
        # forward l2norm(q,k), cumsum, WY, summaries, fold, fused state+output;
        # backward WY apply, state recompute, local dV, first reverse pass, fold, reverse
        # pass, the two chunk-gradient kernels, l2norm backward(dq,dk)
        assert c["triton"] == 15, (name, listing)
        # aten ops with device work (13 before): the forward fold's h0 rows (index_put_),
        # the final state's rows (index), the first backward pass's dht rows (new_zeros,
        # index_put_; the backward fold reuses them), the gather of dh0's first-segment
        # rows (a view only where those are all the rows: a few rows' view would keep the
        # whole fold buffer alive in h0.grad)
        assert c["work"] == 5, (name, listing)
