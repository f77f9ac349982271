"""``segment_size``: long documents as fixed segments (gdn_core.segment), public API."""

from __future__ import annotations

import pytest
import torch
from gdn_core.suites.single_rank_segment_validation import (
    test_segment_size_is_validated,  # noqa: F401 - the shared test, on this package
)
from gdn_core.testkit import assert_close, assert_equal, make_inputs, reference_gdn, run_fwd_bwd
from gdn_det_train import (
    DetWorkspace,
    chunk_gated_delta_rule_det,
    chunk_gdn_det_bwd,
    chunk_gdn_det_fwd,
)

LENGTHS = [300, 5, 200]  # three and four 64-token segments around a short document


@pytest.mark.parametrize("gate", [False, True])
def test_segments_match_the_token_loop(gate):
    inputs, cu, cot = make_inputs(LENGTHS, H=1, HV=2, gate=gate, seed=1)
    got = run_fwd_bwd(chunk_gated_delta_rule_det, inputs, cu, cot, l2norm=True, segment_size=64)
    ref = run_fwd_bwd(reference_gdn, inputs, cu, cot, l2norm=True)
    assert_close(got, ref, 1e-4)
    again = run_fwd_bwd(chunk_gated_delta_rule_det, inputs, cu, cot, l2norm=True,
                        segment_size=64)
    assert_equal(got, again)


def test_split_api_gives_the_autograd_bits():
    inputs, cu, cot = make_inputs(LENGTHS, H=2, HV=4, seed=2)
    auto = run_fwd_bwd(chunk_gated_delta_rule_det, inputs, cu, cot, l2norm=True,
                       segment_size=128)
    q, k, v, g, beta, h0 = (inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    o, ht, saved = chunk_gdn_det_fwd(q, k, v, g, beta, initial_state=h0,
                                     output_final_state=True, cu_seqlens=cu,
                                     use_qk_l2norm_in_kernel=True, segment_size=128)
    assert saved.core.segments is not None
    ws = DetWorkspace.for_inputs(q, v, cu)
    grads = chunk_gdn_det_bwd(saved, cot["do"], cot["dht"], workspace=ws)
    assert torch.equal(o, auto["o"]) and torch.equal(ht, auto["ht"])
    for n in ("q", "k", "v", "g", "beta"):
        assert torch.equal(getattr(grads, "d" + n), auto["d" + n]), n
    assert torch.equal(grads.dh0, auto["dinitial_state"])
