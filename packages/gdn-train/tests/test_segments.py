"""``segment_size``: long documents as fixed segments (gdn_core.segment), public API."""

from __future__ import annotations

import pytest
from gdn_core.suites.single_rank_segment_validation import (
    test_segment_size_is_validated,  # noqa: F401 - the shared test, on this package
)
from gdn_core.testkit import assert_close, make_inputs, reference_gdn, run_fwd_bwd
from gdn_train import chunk_gated_delta_rule, chunk_gdn_bwd, chunk_gdn_fwd

LENGTHS = [300, 5, 200]  # three and four 64-token segments around a short document


@pytest.mark.parametrize("segment_size", [64, 0])
@pytest.mark.parametrize("gate", [False, True])
def test_segments_and_plain_path_match_the_token_loop(gate, segment_size):
    inputs, cu, cot = make_inputs(LENGTHS, H=1, HV=2, gate=gate, seed=1)
    got = run_fwd_bwd(chunk_gated_delta_rule, inputs, cu, cot, l2norm=True,
                      segment_size=segment_size)
    ref = run_fwd_bwd(reference_gdn, inputs, cu, cot, l2norm=True)
    assert_close(got, ref, 1e-4)


def test_split_api_takes_the_segment_size():
    inputs, cu, cot = make_inputs(LENGTHS, H=2, HV=4, seed=2)
    q, k, v, g, beta, h0 = (inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    for S, segmented in ((128, True), (0, False)):
        o, ht, saved = chunk_gdn_fwd(q, k, v, g, beta, initial_state=h0,
                                     output_final_state=True, cu_seqlens=cu,
                                     use_qk_l2norm_in_kernel=True, segment_size=S)
        assert (saved.core.segments is not None) == segmented
        grads = chunk_gdn_bwd(saved, cot["do"], cot["dht"])
        ref = run_fwd_bwd(reference_gdn, inputs, cu, cot, l2norm=True)
        got = {"o": o, "ht": ht, **{"d" + n: getattr(grads, "d" + n)
                                   for n in ("q", "k", "v", "g", "beta")}}
        assert_close(got, {n: ref[n] for n in got}, 1e-4)
