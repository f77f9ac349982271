"""Gloo worker of test_layers.py: one rank of the context-parallel GDN layer (loaded by path)."""

from __future__ import annotations

import gdn_det_train_kcp as kcp
from gdn_core.layers.testing import kcp_rank_run


def layer_rank(rank: int, world_size: int, payload: dict) -> dict:
    return kcp_rank_run(kcp.GatedDeltaNetKCP, kcp.partition_det_kcp, kcp.build_context_det_kcp,
                        rank, world_size, payload)
