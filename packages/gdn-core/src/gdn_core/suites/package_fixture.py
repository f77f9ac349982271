"""The one fixture a package's ``conftest.py`` adds to the shared suites: the package itself.

    package = package_fixture(gdn_train)                        # single-rank suites
    kcp_package = package_fixture(gdn_train_kcp, "kcp_package")  # KCP suites

(the conftest imports its package after the shared fixtures' module, whose import sets
the process up: gdn_core never imports a training package.)

(:mod:`~gdn_core.suites.single_rank_fixtures`, :mod:`~gdn_core.suites.kcp_fixtures`.)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

__all__ = ["package_fixture", "value_fixture"]


def package_fixture(module: ModuleType, name: str = "package") -> Any:
    """A session fixture ``name`` returning ``module`` (the package under test)."""

    @pytest.fixture(scope="session", name=name)
    def fixture() -> ModuleType:
        return module

    fixture.__doc__ = f"The package under test: ``{module.__name__}``."
    return fixture


def value_fixture(value: Any, name: str) -> Any:
    """A session fixture ``name`` returning ``value`` (e.g. a KCP package's
    ``kcp_worker_prefix``)."""

    @pytest.fixture(scope="session", name=name)
    def fixture() -> Any:
        return value

    fixture.__doc__ = f"``{value!r}``, this package's ``{name}``."
    return fixture
