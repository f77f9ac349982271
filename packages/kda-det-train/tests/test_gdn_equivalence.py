"""GDN is KDA with the same decay on every channel."""

from __future__ import annotations

import pytest
import torch
from gdn_core.reference import chunk_gdn_reference
from kda_det_train import chunk_kda_det


@pytest.mark.parametrize("l2norm", [False, True])
def test_broadcast_gate_equals_gdn(l2norm, make_inputs):
    inputs, cu, _ = make_inputs([1, 63, 64, 65, 200], H=2, HV=4, K=32, V=16, g_min=-2.0, seed=11)
    g_scalar = inputs["g"][..., 0]  # [B, T, HV]
    g_kda = g_scalar[..., None].expand(*g_scalar.shape, 32)
    args = (inputs["q"], inputs["k"], inputs["v"])
    kw = dict(initial_state=inputs["initial_state"], output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=l2norm)
    o, ht = chunk_kda_det(*args, g_kda, inputs["beta"], **kw)
    o_ref, ht_ref = chunk_gdn_reference(*args, g_scalar, inputs["beta"], **kw)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-5, atol=2e-5)
