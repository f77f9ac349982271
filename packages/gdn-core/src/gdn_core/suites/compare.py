"""Comparisons of lists of tensors (outputs and gradients), for the shared compile
suites."""

from __future__ import annotations

import torch


def all_equal(got: list, want: list) -> bool:
    """Every pair of tensors the same bits (the lists of the same length)."""
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def assert_all_close_bf16(got: list, want: list) -> None:
    """Every pair within bf16 tolerance (rtol = atol = 2e-2, compared in fp32)."""
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
