"""The fixtures of the KCP packages' test suites, shared.

A KCP package's ``conftest.py`` puts the checkout's sources on ``sys.path`` (a plain
checkout; the gloo workers inherit it), imports everything from here, then its package,
and provides ``kcp_package`` and ``kcp_worker_prefix``
(:mod:`gdn_core.suites.package_fixture`): its worker scripts
next to its tests are ``<prefix>_worker.py`` (the world suite),
``<prefix>_agree_worker.py``, ``<prefix>_compile_worker.py`` and
``<prefix>_nccl_worker.py``; each passes the package's API to a :mod:`gdn_core.suites`
body (gdn_core imports no training package).

Without a GPU, CPU tests run the reference backend (not Triton's interpreter).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

__all__ = ["_cpu_reference_backend", "kcp_agree_worker", "kcp_api", "kcp_compile_worker",
           "kcp_nccl_worker", "kcp_world_worker"]


@pytest.fixture(autouse=True)
def _cpu_reference_backend(monkeypatch):
    """Without a GPU, run the reference backend (not Triton's interpreter)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("GDN_CORE_BACKEND", "reference")
    yield


@pytest.fixture(scope="session")
def kcp_api(kcp_package: ModuleType) -> Any:
    """The package's :class:`gdn_core.kcp_frontend.KCPAPI`, for the shared KCP suites."""
    return kcp_package.ops.API


def _worker(request: pytest.FixtureRequest, prefix: str, role: str) -> Path:
    """The worker script ``<prefix><role>_worker.py`` next to the requesting test module."""
    path = request.path.with_name(f"{prefix}{role}_worker.py")
    if not path.is_file():
        raise FileNotFoundError(f"no worker script {path} (kcp_worker_prefix {prefix!r})")
    return path


def _worker_fixture(name: str, role: str, serves: str) -> Any:
    """A module fixture ``name``: the path of the package's ``<prefix><role>_worker.py``."""

    @pytest.fixture(scope="module", name=name)
    def fixture(request, kcp_worker_prefix: str) -> Path:
        return _worker(request, kcp_worker_prefix, role)

    fixture.__doc__ = f"The worker script of the shared {serves}, in the package's tests."
    return fixture


kcp_world_worker = _worker_fixture("kcp_world_worker", "", "world suite (gloo)")
kcp_agree_worker = _worker_fixture("kcp_agree_worker", "_agree", "agreement suite (gloo)")
kcp_compile_worker = _worker_fixture("kcp_compile_worker", "_compile", "compile suite (gloo)")
kcp_nccl_worker = _worker_fixture("kcp_nccl_worker", "_nccl", "NCCL suite")
