"""The package's conv: a list ``cu_seqlens`` with a non-int entry is a ``TypeError``
(a float was truncated silently; issue 20). Run on a single-rank package through
its ``api`` fixture."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("cu", [[0, 3.7, 8], [0, 3.0, 8], (0, True, 8)])
def test_non_int_entries_are_a_typeerror(api, cu):
    x = torch.randn(1, 8, 2, requires_grad=True)
    with pytest.raises(TypeError, match=r"cu_seqlens entries must be ints, but cu_seqlens\[1\]"):
        api.conv(x, torch.randn(2, 3), None, "silu", cu)
