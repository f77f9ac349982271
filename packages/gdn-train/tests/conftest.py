"""gdn-train tests: the process set-up and fixtures of
:mod:`gdn_core.suites.single_rank_fixtures` (deterministic algorithms, the CPU
reference backend, one intra-op thread), and this package as ``package``.

In a plain checkout (packages not installed) the sources of this package and of
gdn-core are put on ``sys.path``; an installed package takes precedence.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PACKAGES = Path(__file__).resolve().parents[2]
for _name, _src in (("gdn_core", "gdn-core/src"), ("gdn_train", "gdn-train/src")):
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(_PACKAGES / _src))

from gdn_core.suites.single_rank_fixtures import *  # noqa: E402,F403 - set-up and shared fixtures


@pytest.fixture(scope="session")
def package():
    """This package (the imported module), for the shared suites."""
    import gdn_train

    return gdn_train
