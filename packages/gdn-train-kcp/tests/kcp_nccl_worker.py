"""One rank of an NCCL world of the shared NCCL test (:mod:`gdn_core.suites.kcp_nccl`),
loaded by path: the body is gdn_core's, the API this package's."""

from __future__ import annotations

import gdn_train_kcp as kcp
from gdn_core.suites import kcp_nccl_rank


def nccl_checks(rank: int, world_size: int, payload: dict) -> list[dict]:
    return kcp_nccl_rank.nccl_checks(kcp.ops.API, rank, world_size, payload)
