"""pytest plugin for GPU runs under pytest-xdist: one fault, one failure.

An illegal memory access is sticky: every later CUDA call of the process
fails with the same error, so under ``-n`` one faulty kernel fails every test
its worker runs afterwards (KDA, conv1d, ... — 30 failures for one fault in
the 2026-11-30 H200 run). With this plugin, a worker whose CUDA context is
broken after a test ends at once, after that test's reports went out; xdist
starts a fresh worker for the tests still to run. Costs one
``torch.cuda.synchronize()`` per test.

    python -m pytest -p gdn_core.pytest_cuda_guard -n 16 -m gpu ...
"""

from __future__ import annotations

import os
import sys

__all__ = ["pytest_runtest_logfinish", "cuda_context_broken"]


def cuda_context_broken() -> str | None:
    """The error a synchronisation raises if CUDA is in use and its context is
    broken, else ``None``."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:  # torch.AcceleratorError is a RuntimeError
        return str(exc).splitlines()[0]
    return None


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    """After a test's reports: end the process if the test broke the CUDA context."""
    err = cuda_context_broken()
    if err is not None:
        sys.stderr.write(f"\n[gdn_core.pytest_cuda_guard] CUDA context broken after {nodeid}: "
                         f"{err} — ending this worker so the next tests get a fresh one\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(3)
