"""``segment_size`` is validated by the autograd and the split calls (a multiple of
the chunk size, not negative), and a :class:`~gdn_core.layout.VarlenLayout` runs
without segments. Run on a single-rank package through its ``api`` fixture."""

from __future__ import annotations

import pytest

from gdn_core.layout import VarlenLayout
from gdn_core.testkit import make_inputs


def test_segment_size_is_validated(api):
    inputs, cu, _ = make_inputs([70], seed=3)
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    for bad in (100, -64):
        with pytest.raises(ValueError, match="segment_size"):
            api.autograd(q, k, v, g, beta, cu_seqlens=cu, segment_size=bad)
        with pytest.raises(ValueError, match="segment_size"):
            api.fwd(q, k, v, g, beta, cu_seqlens=cu, segment_size=bad)
    with pytest.raises(ValueError, match="VarlenLayout runs without segments"):
        api.autograd(q, k, v, g, beta, cu_seqlens=VarlenLayout(cu.tolist()), segment_size=64)
