"""The KCP causal conv1d across ranks: a NaN or Inf in one document never reaches
another (issue 20), whether the documents meet inside a shard or at a cut.

Simulated worlds of 1-3 ranks: the value is planted in one document's ``x`` or
output gradient; the gathered ``y`` and ``dx`` of every other document are bit for
bit those of a clean run. Run on a KCP package by its test module
(``from … import *``) with its ``kcp_api`` fixture (the package's
:class:`gdn_core.kcp_frontend.KCPAPI`).
"""

from __future__ import annotations

import pytest
import torch

from gdn_core.containment import NON_FINITE, check_conv_containment

OFFS = [0, 5, 6, 13, 20]


def _world_conv(kcp_api, world: int):
    plan = kcp_api.partition(OFFS, world, boundary="even")
    ctxs = kcp_api.build_simulated_contexts(plan)
    cuts = [slice(*plan.token_range(r)) for r in range(world)]

    def conv(x, w, b):
        return torch.cat(kcp_api.conv_simulated([x[:, c] for c in cuts], w, b, ctxs), 1)

    return conv


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("where", ["x", "dy"])
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("doc", range(len(OFFS) - 1))
def test_nonfinite_stays_in_its_document(kcp_api, world, where, value, doc):
    check_conv_containment(_world_conv(kcp_api, world), OFFS, where, value, doc)
