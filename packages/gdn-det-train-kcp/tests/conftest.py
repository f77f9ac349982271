"""gdn-det-train-kcp tests: the shared KCP fixtures (:mod:`gdn_core.suites.kcp_fixtures`; CPU
runs use the fp32 reference backend), this package as ``kcp_package`` and its
worker scripts' prefix.

When the repository's packages are not installed (a plain checkout), their
``src`` directories are put on ``sys.path`` (and so reach the gloo worker
processes too).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

_PACKAGES = Path(__file__).resolve().parents[2]
for _name, _dir in (("gdn_core", "gdn-core"), ("gdn_det_train_kcp", "gdn-det-train-kcp")):
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(_PACKAGES / _dir / "src"))

from gdn_core.suites.kcp_fixtures import *  # noqa: E402,F403 - the shared KCP fixtures


@pytest.fixture(scope="session")
def kcp_package():
    """This package, for the shared KCP suites (:mod:`gdn_core.suites`)."""
    import gdn_det_train_kcp

    return gdn_det_train_kcp


@pytest.fixture(scope="session")
def kcp_worker_prefix() -> str:
    """Its worker scripts here are ``det_kcp_worker.py``, ``det_kcp_agree_worker.py``, …"""
    return "det_kcp"
