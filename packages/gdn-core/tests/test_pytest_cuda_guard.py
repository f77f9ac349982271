"""gdn_core.pytest_cuda_guard: a broken CUDA context ends the worker; a healthy
one (or none) does not."""

from __future__ import annotations

import pytest
import torch
from gdn_core import pytest_cuda_guard as guard


class _Exit(Exception):
    pass


def _patch(monkeypatch, *, initialized: bool, sync_error: Exception | None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)

    def sync():
        if sync_error is not None:
            raise sync_error

    monkeypatch.setattr(torch.cuda, "synchronize", sync)

    def fake_exit(code):
        raise _Exit(code)

    monkeypatch.setattr(guard.os, "_exit", fake_exit)


def test_a_broken_context_ends_the_worker(monkeypatch, capsys):
    _patch(monkeypatch, initialized=True,
           sync_error=RuntimeError("CUDA error: an illegal memory access was encountered\nmore"))
    with pytest.raises(_Exit) as exc:
        guard.pytest_runtest_logfinish("pkg/test_x.py::test_y", None)
    assert exc.value.args == (3,)
    err = capsys.readouterr().err
    assert "test_x.py::test_y" in err and "illegal memory access" in err and "more" not in err


@pytest.mark.parametrize("initialized", [False, True])
def test_a_healthy_or_unused_context_keeps_it(monkeypatch, initialized):
    _patch(monkeypatch, initialized=initialized, sync_error=None)
    guard.pytest_runtest_logfinish("pkg/test_x.py::test_y", None)  # no exit
    assert guard.cuda_context_broken() is None
