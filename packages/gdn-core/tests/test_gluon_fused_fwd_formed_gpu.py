"""The fused forward with W and U formed on chip (``gdn_core.ops.gluon.fused_fwd_formed``)
on the GPU: against the fused forward it would replace
(:func:`~gdn_core.ops.gluon.fused_fwd.chunk_fwd_fused_gluon` on the W and U that
:func:`~gdn_core.ops.gluon.wy.wy_fwd_gluon` writes beside the 16-bit inverse), ``o`` and
the final states bitwise equal, for packed documents with short last chunks and an empty
one, group 1 and 2, bf16 and fp16, with and without entry states; and the WY forward
without W and U gives the same inverse bits."""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.testkit import offsets_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = [1, 63, 64, 65, 0, 200, 777, 130]
D = 128


def _problem(H, group, dtype, seed=0):
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.gluon import available

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(LENGTHS)
    T, HV = offs[-1], H * group
    index = ChunkIndex.build(offs, "cuda")
    q = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    k = R.l2_normalize(torch.randn(T, H, D, generator=gen)).to("cuda", dtype)
    v = torch.randn(T, HV, D, generator=gen).to("cuda", dtype)
    beta = (torch.rand(T, HV, generator=gen) * 0.9 + 0.05).to("cuda", dtype)
    g = (-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).cuda()
    G = chunk_cumsum_fwd(g, index)
    h0 = (torch.randn(len(LENGTHS), HV, D, D, generator=gen) * 0.5).cuda()
    return index, (q, k, v, beta, G), h0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("with_h0", [True, False])
def test_bitwise_the_fused_forward_on_the_wy_forwards_w_and_u(dtype, group, with_h0):
    from gdn_core.ops.gluon.fused_fwd import chunk_fwd_fused_gluon
    from gdn_core.ops.gluon.fused_fwd_formed import chunk_fwd_formed_gluon
    from gdn_core.ops.gluon.wy import wy_fwd_gluon

    index, (q, k, v, beta, G), h0 = _problem(2, group, dtype)
    h0 = h0 if with_h0 else None
    A_inv, W, U = wy_fwd_gluon(k, v, beta, G, index, group, A_inv_for_backward=True)
    A_only, W0, U0 = wy_fwd_gluon(k, v, beta, G, index, group, A_inv_for_backward=True,
                                  output_WU=False)
    assert W0 is None and U0 is None and torch.equal(A_only, A_inv)
    o_ref, f_ref = chunk_fwd_fused_gluon(q, k, W, U, G, 0.3, index, group, initial_state=h0,
                                         output_final_state=True)
    o, f = chunk_fwd_formed_gluon(q, k, v, beta, G, A_inv, 0.3, index, group,
                                  initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    assert torch.equal(o, o_ref), (o.float() - o_ref.float()).abs().max()
    assert torch.equal(f, f_ref), (f - f_ref).abs().max()
    o2, f2 = chunk_fwd_formed_gluon(q, k, v, beta, G, A_inv, 0.3, index, group,
                                    initial_state=h0, output_final_state=True)
    assert torch.equal(o2, o) and torch.equal(f2, f)
