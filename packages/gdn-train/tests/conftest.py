"""gdn-train tests: the shared single-rank suites' set-up and fixtures
(:mod:`gdn_core.suites.single_rank_fixtures`: deterministic algorithms, the CPU reference
backend, one intra-op thread) and this package as ``package``. In a plain checkout (not
installed) the sources of gdn-core and of this package are put on ``sys.path``."""

import importlib.util
import sys
from pathlib import Path

_PACKAGES = Path(__file__).resolve().parents[2]
for _name in ("gdn_core", "gdn_train"):
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(_PACKAGES / _name.replace("_", "-") / "src"))

from gdn_core.suites.package_fixture import package_fixture  # noqa: E402
from gdn_core.suites.single_rank_fixtures import *  # noqa: E402,F403

# isort: split
import gdn_train  # noqa: E402 - after the shared fixtures' set-up

package = package_fixture(gdn_train)
