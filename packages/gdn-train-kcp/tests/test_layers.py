"""gdn_train_kcp.GatedDeltaNetKCP over a gloo world of 2 ranks against the single-rank layer on
the whole packed sequence: outputs, input gradients, parameter gradients summed over
ranks (gdn_core.layers.testing)."""

from __future__ import annotations

from pathlib import Path

from gdn_core.layers.testing import KCPLayerChecks


class TestGatedDeltaNetKCP(KCPLayerChecks):
    worker = Path(__file__).with_name("layer_kcp_worker.py")
