"""torch state around a test, for the shared suites: deterministic algorithms, a fresh
torch.compile, and the comparisons of the compile suites."""

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


def all_equal(got: list, want: list) -> bool:
    """Every pair of tensors the same bits (the lists of the same length)."""
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def assert_all_close_bf16(got: list, want: list) -> None:
    """Every pair within bf16 tolerance (rtol = atol = 2e-2, compared in fp32)."""
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
