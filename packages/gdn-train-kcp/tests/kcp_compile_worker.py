"""Gloo worker of the shared compile test (:mod:`gdn_core.suites.kcp_compile`), loaded by
path: the body is gdn_core's, the API this package's."""

from __future__ import annotations

import gdn_train_kcp as kcp
from gdn_core.suites.kcp_compile_block import compile_worker as _compile_worker


def compile_worker(rank: int, world_size: int, payload: dict) -> dict:
    return _compile_worker(kcp.ops.API, rank, world_size, payload)
