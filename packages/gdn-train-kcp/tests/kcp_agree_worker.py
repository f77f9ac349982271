"""Gloo worker of test_kcp_agreement.py (loaded by path): the agreement scenarios of
:mod:`gdn_core.kcp.agree_checks` with this package."""

from __future__ import annotations

import gdn_train_kcp as kcp
from gdn_core.kcp.agree_checks import run_scenarios


def agreement_scenarios(rank: int, world_size: int, payload: object) -> dict:
    return run_scenarios(kcp, rank)
