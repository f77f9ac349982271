"""gdn-train-kcp tests: the shared KCP fixtures (:mod:`gdn_core.suites.kcp_fixtures`; CPU runs
use the fp32 reference backend), this package as ``kcp_package`` and its worker scripts'
prefix (``kcp_worker.py``, ``kcp_agree_worker.py``, …). In a plain checkout (not
installed) the sources of gdn-core and of this package are put on ``sys.path`` (the gloo
workers inherit it)."""

import importlib.util
import sys
from pathlib import Path

_PACKAGES = Path(__file__).resolve().parents[2]
for _name in ("gdn_core", "gdn_train_kcp"):
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(_PACKAGES / _name.replace("_", "-") / "src"))

from gdn_core.suites.kcp_fixtures import *  # noqa: E402,F403
from gdn_core.suites.package_fixture import package_fixture, value_fixture  # noqa: E402

# isort: split
import gdn_train_kcp  # noqa: E402 - after the shared fixtures' set-up

kcp_package = package_fixture(gdn_train_kcp, "kcp_package")
kcp_worker_prefix = value_fixture("kcp", "kcp_worker_prefix")
