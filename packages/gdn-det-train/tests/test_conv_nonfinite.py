"""causal_conv1d_det: a NaN or Inf in one document never reaches another (issue 20).

Planted in one document's ``x`` or in the output gradient: every other
document's ``y`` and ``dx`` are bit for bit those of a clean run, with
``cu_seqlens`` as a list, a tensor or a :class:`~gdn_core.layout.VarlenLayout`.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.containment import NON_FINITE, assert_other_documents_equal, plant
from gdn_core.layout import VarlenLayout
from gdn_det_train import causal_conv1d_det as conv

OFFS = [0, 5, 6, 13, 20]
CU = {"list": lambda: OFFS, "tensor": lambda: torch.tensor(OFFS),
      "layout": lambda: VarlenLayout(OFFS)}


def _y_dx(x, w, b, dy, cu):
    x = x.clone().requires_grad_()
    y = conv(x, w, b, "silu", cu)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("cu", sorted(CU))
@pytest.mark.parametrize("where", ["x", "dy"])
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("doc", range(len(OFFS) - 1))
def test_nonfinite_stays_in_its_document(cu, where, value, doc):
    gen = torch.Generator().manual_seed(3)
    x, dy = (torch.randn(1, OFFS[-1], 4, generator=gen) for _ in range(2))
    w, b = torch.randn(4, 4, generator=gen), torch.randn(4, generator=gen)
    y0, dx0 = _y_dx(x, w, b, dy, CU[cu]())
    if where == "x":
        x = plant(x, OFFS, doc, value)
    else:
        dy = plant(dy, OFFS, doc, value)
    y, dx = _y_dx(x, w, b, dy, CU[cu]())
    assert_other_documents_equal(y, y0, OFFS, doc, "y")
    assert_other_documents_equal(dx, dx0, OFFS, doc, "dx")
