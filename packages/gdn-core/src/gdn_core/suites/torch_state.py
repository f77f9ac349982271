"""torch state around a test, for the shared suites: deterministic algorithms and a
fresh torch.compile (and no graph break in it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._dynamo.utils import counters


@contextmanager
def deterministic_algorithms(switch_on: bool) -> Iterator[None]:
    """With ``switch_on``, torch's deterministic algorithms on meanwhile; the setting
    before restored after (either way)."""
    before = torch.are_deterministic_algorithms_enabled()
    if switch_on:
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@contextmanager
def fresh_dynamo(deterministic_algorithms_on: bool) -> Iterator[None]:
    """Dynamo reset and its counters cleared before, reset again after; with
    ``deterministic_algorithms_on``, torch's deterministic algorithms on meanwhile."""
    with deterministic_algorithms(deterministic_algorithms_on):
        torch._dynamo.reset()
        counters.clear()
        try:
            yield
        finally:
            torch._dynamo.reset()


def no_graph_breaks() -> None:
    assert not counters["graph_break"], dict(counters["graph_break"])
