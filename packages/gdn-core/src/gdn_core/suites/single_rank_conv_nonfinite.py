"""causal_conv1d: a NaN or Inf in one document never reaches another (issue 20).

Planted in one document's ``x`` or in the output gradient: every other
document's ``y`` and ``dx`` are bit for bit those of a clean run, with
``cu_seqlens`` as a list, a tensor or a :class:`~gdn_core.layout.VarlenLayout`.
Run on a package by its test module (``from … import *``) with its ``api`` fixture.
"""

from __future__ import annotations

import pytest
import torch

from gdn_core.containment import NON_FINITE, check_conv_containment
from gdn_core.layout import VarlenLayout

OFFS = [0, 5, 6, 13, 20]
CU = {"list": lambda: OFFS, "tensor": lambda: torch.tensor(OFFS),
      "layout": lambda: VarlenLayout(OFFS)}


@pytest.mark.parametrize("cu", sorted(CU))
@pytest.mark.parametrize("where", ["x", "dy"])
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("doc", range(len(OFFS) - 1))
def test_nonfinite_stays_in_its_document(api, cu, where, value, doc):
    check_conv_containment(lambda x, w, b: api.conv(x, w, b, "silu", CU[cu]()), OFFS, where,
                           value, doc)
