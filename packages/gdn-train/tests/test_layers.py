"""gdn_train.GatedDeltaNet: against transformers' Qwen3-Next layer, and packed documents
against separate ones (gdn_core.layers.testing)."""

from __future__ import annotations

from gdn_core.layers.testing import LayerChecks
from gdn_train import GatedDeltaNet


class TestGatedDeltaNet(LayerChecks):
    layer_cls, seed = GatedDeltaNet, 8
