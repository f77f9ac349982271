"""gdn-det-train tests.

* Every test runs under ``torch.use_deterministic_algorithms(True)``.
* ``CUBLAS_WORKSPACE_CONFIG`` is set before CUDA starts (cuBLAS refuses
  deterministic mode without it).
* One intra-op thread: the shapes are tiny; on a busy 2-core machine OpenMP
  spinning makes them many times slower.
* In a plain checkout (packages not installed) the sources of this package and
  of gdn-core are put on ``sys.path``; an installed package takes precedence.
* CPU tensors run gdn_core's reference backend here: ``TRITON_INTERPRET`` is
  removed from this process (the interpreter test sets it in a subprocess).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("GDN_CORE_BACKEND", None)
torch.set_num_threads(1)

_PACKAGES = Path(__file__).resolve().parents[2]
for _name, _src in (("gdn_core", "gdn-core/src"), ("gdn_det_train", "gdn-det-train/src")):
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(_PACKAGES / _src))
# the shared test helpers (det_helpers.py) next to this file
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.fixture
def api():
    """This package's public calls, for the shared suites of :mod:`gdn_core.suites`."""
    from gdn_det_train.ops import API

    return API


@pytest.fixture(scope="session")
def package():
    """This package (the imported module), for the shared suites that start child
    interpreters importing it."""
    import gdn_det_train

    return gdn_det_train
