"""gdn_train_kcp.GatedDeltaNetKCP over a gloo world of 2 ranks against the single-rank layer on the
whole packed sequence: outputs, input gradients, parameter gradients summed over ranks."""

from __future__ import annotations

from pathlib import Path

from gdn_core.kcp.testing import run_gloo_world
from gdn_core.layers.testing import diff_kcp_vs_single_rank

WORKER = Path(__file__).with_name("layer_kcp_worker.py")


def test_two_ranks_match_the_single_rank_layer():
    # the 80-token document crosses the cut; a 3-token one sits on the second rank
    payload = {"offsets": [0, 30, 110, 113, 140], "boundary": "even", "seed": 11}
    ranks = run_gloo_world(2, WORKER, "layer_rank", payload)
    assert [r["start"] for r in ranks] == [0, 70] and ranks[-1]["stop"] == 140
    diffs = diff_kcp_vs_single_rank(ranks, payload)
    assert len(diffs) == 15 and max(diffs.values()) < 1e-5, diffs
