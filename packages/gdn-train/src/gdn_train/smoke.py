"""A tiny CPU forward+backward: the import-independence checker's smoke entry point."""

from __future__ import annotations

import torch

from gdn_train.api import chunk_gated_delta_rule, chunk_gdn_bwd, chunk_gdn_fwd
from gdn_train.conv import causal_conv1d


def run() -> None:
    """Conv1d, then GDN with the in-kernel gate, autograd and split API, on CPU."""
    gen = torch.Generator().manual_seed(0)
    T, H, K = 8, 1, 16
    x = torch.randn(1, T, 3 * H * K, generator=gen, requires_grad=True)
    w = torch.randn(3 * H * K, 4, generator=gen, requires_grad=True)
    y = causal_conv1d(x, w, None, "silu", cu_seqlens=[0, 3, T])
    q, k, v = y.reshape(1, T, 3, H, K).unbind(2)
    g = torch.randn(1, T, H, generator=gen, requires_grad=True)
    beta = torch.rand(1, T, H, generator=gen)
    A_log = torch.zeros(H, requires_grad=True)
    dt_bias = torch.zeros(H, requires_grad=True)
    o, _ = chunk_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=[0, 3, T], use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
    )
    o.sum().backward()
    o2, _, saved = chunk_gdn_fwd(q.detach(), k.detach(), v.detach(), g.detach(), beta)
    chunk_gdn_bwd(saved, torch.ones_like(o2))
