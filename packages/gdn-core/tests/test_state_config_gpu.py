"""The state kernel's bits do not depend on how many documents share its launch.

Its value-block width follows the launch's program count
(:func:`gdn_core.ops.chunk_state.chunk_state_config`): 8 documents × 16 value
heads take ``BV = 64``, one document alone ``BV = 32``. Partition invariance
needs each document's states to be the same bits either way.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import chunk_state_fwd
from gdn_core.ops.chunk_state import chunk_state_config


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group", [1, 2])
def test_state_bits_same_alone_and_in_a_wide_launch(group):
    lengths, H, D = [300, 64, 1, 129, 700, 65, 200, 450], 16 // group, 128
    HV = H * group
    N = len(lengths)
    assert chunk_state_config(D, D, 2, programs=N * HV)["BV"] == 64
    assert chunk_state_config(D, D, 2, programs=HV)["BV"] == 32
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    gen = torch.Generator().manual_seed(3)
    T = offs[-1]
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", torch.bfloat16)
    W = (torch.randn(T, HV, D, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    U = torch.randn(T, HV, D, generator=gen).to("cuda", torch.bfloat16)
    G = torch.cumsum(-torch.rand(T, HV, generator=gen) * 0.05, 0).cuda()
    h0 = torch.randn(N, HV, D, D, generator=gen).cuda()
    index = ChunkIndex.build(offs, "cuda")
    h, vn, fin = chunk_state_fwd(k, W, U, G, index, group, h0, output_final_state=True)
    c0 = 0
    for n, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
        G_doc = G[a:b].contiguous()
        one = ChunkIndex.build([0, b - a], "cuda")
        h1, vn1, fin1 = chunk_state_fwd(k[a:b], W[a:b], U[a:b], G_doc, one, group, h0[n:n + 1],
                                        output_final_state=True)
        nc = one.num_chunks
        assert torch.equal(h[c0:c0 + nc], h1), n
        assert torch.equal(vn[a:b], vn1), n
        assert torch.equal(fin[n], fin1[0]), n
        c0 += nc
