"""The process set-up and fixtures of the single-rank packages' test suites.

A package's ``conftest.py`` puts the checkout's sources on ``sys.path`` (a plain
checkout), imports everything from here, then its package, and provides the ``package``
fixture (:func:`gdn_core.suites.package_fixture.package_fixture`). Importing this module:

* sets ``CUBLAS_WORKSPACE_CONFIG`` before CUDA starts (cuBLAS refuses deterministic
  mode without it);
* removes ``TRITON_INTERPRET`` and ``GDN_CORE_BACKEND`` from this process: CPU
  tensors run gdn_core's reference backend (the interpreter tests set them in a
  subprocess);
* runs one intra-op thread: the shapes are tiny; on a busy 2-core machine OpenMP
  spinning makes them many times slower.

Every test runs under ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import pytest
import torch

from gdn_core import testkit
from gdn_core.suites.torch_state import deterministic_algorithms

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("GDN_CORE_BACKEND", None)
torch.set_num_threads(1)

__all__ = ["_deterministic", "api", "run_script"]


@pytest.fixture(autouse=True)
def _deterministic():
    with deterministic_algorithms(True):
        yield


@pytest.fixture
def api(package: ModuleType) -> Any:
    """The package's public calls (its :class:`gdn_core.frontend.SingleRankAPI`), for
    the shared suites of :mod:`gdn_core.suites`."""
    return package.ops.API


@pytest.fixture
def run_script(package: ModuleType) -> Callable[..., list[dict]]:
    """:func:`gdn_core.testkit.run_script` with children importing the package."""
    return partial(testkit.run_script, package=package)
