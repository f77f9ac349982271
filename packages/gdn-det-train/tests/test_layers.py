"""gdn_det_train.GatedDeltaNet: against transformers' Qwen3-Next layer, packed documents
(gdn_core.layers.testing), and bitwise-repeatable gradients."""

from __future__ import annotations

import torch
from gdn_core.layers.testing import TINY, LayerChecks, tiny_layer
from gdn_det_train import GatedDeltaNet


class TestGatedDeltaNet(LayerChecks):
    layer_cls, seed = GatedDeltaNet, 5


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
