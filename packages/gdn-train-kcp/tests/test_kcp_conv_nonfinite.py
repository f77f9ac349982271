"""causal_conv1d_kcp across ranks: a NaN or Inf in one document never reaches
another (issue 20), whether the documents meet inside a shard or at a cut.

Simulated worlds of 1-3 ranks: the value is planted in one document's ``x`` or
output gradient; the gathered ``y`` and ``dx`` of every other document are
bit for bit those of a clean run.
"""

from __future__ import annotations

import gdn_train_kcp as kcp
import pytest
import torch
from gdn_core.containment import NON_FINITE, assert_other_documents_equal, plant

OFFS = [0, 5, 6, 13, 20]


def _y_dx(x, w, b, dy, world):
    plan = kcp.partition_kcp(OFFS, world, boundary="even")
    ctxs = kcp.build_simulated_contexts_kcp(plan)
    xs = [x[:, slice(*plan.token_range(r))].clone().requires_grad_() for r in range(world)]
    ys = kcp.causal_conv1d_kcp_simulated(xs, w, b, ctxs)
    torch.cat(ys, 1).backward(dy)
    return torch.cat(ys, 1).detach(), torch.cat([t.grad for t in xs], 1)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("where", ["x", "dy"])
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("doc", range(len(OFFS) - 1))
def test_nonfinite_stays_in_its_document(world, where, value, doc):
    gen = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(1, OFFS[-1], 4, generator=gen) for _ in range(2))
    w, b = torch.randn(4, 4, generator=gen), torch.randn(4, generator=gen)
    y0, dx0 = _y_dx(x, w, b, dy, world)
    if where == "x":
        x = plant(x, OFFS, doc, value)
    else:
        dy = plant(dy, OFFS, doc, value)
    y, dx = _y_dx(x, w, b, dy, world)
    assert_other_documents_equal(y, y0, OFFS, doc, "y")
    assert_other_documents_equal(dx, dx0, OFFS, doc, "dx")
