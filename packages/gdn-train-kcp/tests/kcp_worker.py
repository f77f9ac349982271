"""Gloo worker of the shared world tests (:mod:`gdn_core.suites.kcp_distributed`),
loaded by path: the body is gdn_core's, the API this package's."""

from __future__ import annotations

import gdn_train_kcp as kcp
from gdn_core.suites import kcp_world_cases


def world_checks(rank: int, world_size: int, payload: dict) -> dict:
    return kcp_world_cases.world_checks(kcp.ops.API, rank, world_size, payload)
