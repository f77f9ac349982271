"""gdn_det_train.GatedDeltaNet: the layer on this package's kernels against transformers'
Qwen3-Next layer, packed documents, and bitwise-repeatable gradients."""

from __future__ import annotations

import pytest
import torch
from gdn_core.layers.testing import TINY, diff_packed_vs_separate, diff_vs_qwen3_next, tiny_layer
from gdn_det_train import GatedDeltaNet


def test_matches_transformers_qwen3_next_layer_and_every_gradient():
    pytest.importorskip("transformers")
    diffs = diff_vs_qwen3_next(GatedDeltaNet, seed=5)
    assert len(diffs) == 9 and max(diffs.values()) < 2e-4, diffs


def test_packed_documents_equal_documents_run_alone():
    diffs = diff_packed_vs_separate(tiny_layer(GatedDeltaNet, seed=6), [40, 3, 70])
    assert max(diffs.values()) < 1e-5, diffs


def test_gradients_are_bitwise_repeatable():
    layer = tiny_layer(GatedDeltaNet, seed=7)
    x = torch.randn(1, 90, TINY["hidden_size"])

    def grads():
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x, cu_seqlens=[0, 50, 90])
        (out * out).sum().backward()
        return [p.grad.clone() for p in layer.parameters()]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(g.abs().sum() > 0 for g in first)
