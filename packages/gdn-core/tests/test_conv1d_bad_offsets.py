"""gdn_core.conv1d: a list ``cu_seqlens`` with an entry that is not an int is a
``TypeError`` (a float was truncated silently; issue 20)."""

from __future__ import annotations

import pytest
import torch
from gdn_core.conv1d import causal_conv1d, causal_conv1d_bwd, causal_conv1d_fwd

BAD = [[0, 3.7, 8], [0, 3.0, 8], (0, True, 8), [0, "3", 8], [0, None, 8]]


@pytest.mark.parametrize("cu", BAD)
def test_non_int_entries_are_a_typeerror(cu):
    x, w = torch.randn(1, 8, 2), torch.randn(2, 3)
    with pytest.raises(TypeError, match=r"cu_seqlens entries must be ints, but cu_seqlens\[1\]"):
        causal_conv1d(x, w, None, "silu", cu)
    with pytest.raises(TypeError, match="cu_seqlens entries must be ints"):
        causal_conv1d_fwd(x, w, None, "silu", cu)
    with pytest.raises(TypeError, match="cu_seqlens entries must be ints"):
        causal_conv1d_bwd(x, w, None, x, "silu", cu, deterministic=True)


def test_int_like_entries_still_work():
    import numpy as np

    x, w = torch.randn(1, 8, 2), torch.randn(2, 3)
    ref = causal_conv1d_fwd(x, w, None, "silu", [0, 3, 8])
    assert torch.equal(causal_conv1d_fwd(x, w, None, "silu", (0, np.int64(3), 8)), ref)
