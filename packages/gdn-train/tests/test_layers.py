"""gdn_train.GatedDeltaNet: the layer on this package's kernels against transformers'
Qwen3-Next layer, and packed documents against separate ones."""

from __future__ import annotations

import pytest
from gdn_core.layers.testing import diff_packed_vs_separate, diff_vs_qwen3_next, tiny_layer
from gdn_train import GatedDeltaNet


def test_matches_transformers_qwen3_next_layer_and_every_gradient():
    pytest.importorskip("transformers")
    diffs = diff_vs_qwen3_next(GatedDeltaNet, seed=8)
    assert len(diffs) == 9 and max(diffs.values()) < 2e-4, diffs


def test_packed_documents_equal_documents_run_alone():
    diffs = diff_packed_vs_separate(tiny_layer(GatedDeltaNet, seed=9), [40, 3, 70])
    assert max(diffs.values()) < 1e-5, diffs
