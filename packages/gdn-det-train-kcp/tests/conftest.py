"""gdn-det-train-kcp tests: CPU runs use the fp32 reference backend.

When the repository's packages are not installed (a plain checkout), their
``src`` directories are put on ``sys.path`` (and so reach the gloo worker
processes too).
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PACKAGES = Path(__file__).resolve().parents[2]
for _name, _dir in (("gdn_core", "gdn-core"), ("gdn_det_train_kcp", "gdn-det-train-kcp")):
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(_PACKAGES / _dir / "src"))


@pytest.fixture(autouse=True)
def _cpu_reference_backend(monkeypatch):
    """Without a GPU, run the reference backend (not Triton's interpreter)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("GDN_CORE_BACKEND", "reference")
    yield


@pytest.fixture(scope="session")
def kcp_package():
    """This package, for the shared KCP suites (:mod:`gdn_core.suites`)."""
    import gdn_det_train_kcp

    return gdn_det_train_kcp


@pytest.fixture(scope="session")
def kcp_api(kcp_package):
    """This package's :class:`gdn_core.kcp_frontend.KCPAPI`, for the shared KCP suites."""
    return kcp_package.ops.API


@pytest.fixture(scope="session")
def kcp_agree_worker():
    """The gloo worker script of the shared agreement suite, in this package's tests."""
    return Path(__file__).with_name("det_kcp_agree_worker.py")


@pytest.fixture(scope="session")
def kcp_compile_worker():
    """The gloo worker script of the shared compile suite, in this package's tests."""
    return Path(__file__).with_name("det_kcp_compile_worker.py")


@pytest.fixture(scope="session")
def kcp_world_worker():
    """The gloo worker script of the shared world suite, in this package's tests."""
    return Path(__file__).with_name("det_kcp_worker.py")


@pytest.fixture(scope="session")
def kcp_nccl_worker():
    """The NCCL worker script of the shared NCCL suite, in this package's tests."""
    return Path(__file__).with_name("det_kcp_nccl_worker.py")
