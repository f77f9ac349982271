"""Test helpers: is a non-finite value contained in its document?

Every training package checks that a NaN or Inf planted in one document of a
packed sequence leaves every other document's outputs and gradients bit for
bit those of a clean run; these are the two steps of that check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["NON_FINITE", "assert_other_documents_equal", "plant"]

NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def plant(t: torch.Tensor, offsets: Sequence[int], doc: int, value: float) -> torch.Tensor:
    """A copy of ``t [1, T, ...]`` with ``value`` at every token of document ``doc``
    (``offsets``: the host ``cu_seqlens``)."""
    t = t.detach().clone()
    t[0, offsets[doc]:offsets[doc + 1]] = value
    return t


def assert_other_documents_equal(got: torch.Tensor, clean: torch.Tensor,
                                 offsets: Sequence[int], doc: int, what: str) -> None:
    """``got`` equals ``clean`` bit for bit on the tokens of every document but ``doc``
    (``[1, T, ...]`` tensors). Raises ``AssertionError`` naming the first that differs."""
    for n in range(len(offsets) - 1):
        if n == doc:
            continue
        a, b = got[0, offsets[n]:offsets[n + 1]], clean[0, offsets[n]:offsets[n + 1]]
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: document {n} changed by a non-finite value "
                                 f"planted in document {doc}")
