"""World of one on CPU, no process group: the import checker's smoke entry point."""

import torch
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd

from gdn_train_kcp.conv import causal_conv1d_kcp
from gdn_train_kcp.gdn import chunk_gated_delta_rule_kcp
from gdn_train_kcp.plan import build_context_kcp, partition_kcp


def run() -> None:
    """A tiny conv + KCP GDN forward/backward at world_size 1, checked against
    the single-rank path."""
    gen = torch.Generator().manual_seed(0)
    offsets = [0, 5, 12]
    T, H, K, V, D = 12, 1, 16, 16, 8
    plan = partition_kcp(offsets, 1)
    ctx = build_context_kcp(plan, 0, device="cpu", conv_kernel_size=4)
    x = torch.randn(1, T, D, generator=gen, requires_grad=True)
    w = torch.randn(D, 4, generator=gen, requires_grad=True)
    causal_conv1d_kcp(x, w, None, ctx).sum().backward()
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.rand(1, T, H, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    o = chunk_gated_delta_rule_kcp(*leaves, context=ctx, use_qk_l2norm_in_kernel=True,
                                       backend="reference")
    do = torch.randn(o.shape, generator=gen)
    o.backward(do)
    o_ref, _, saved = chunk_gdn_fwd(q, k, v, g, beta, cu_seqlens=offsets,
                                    use_qk_l2norm_in_kernel=True, deterministic=False,
                                    backend="reference")
    ref = chunk_gdn_bwd(saved, do, deterministic=False)
    if not torch.allclose(o, o_ref, rtol=1e-5, atol=1e-5):
        raise AssertionError("world_size=1 output differs from the single-rank result")
    for leaf, want in zip(leaves, (ref.dq, ref.dk, ref.dv, ref.dg, ref.dbeta)):
        if not torch.allclose(leaf.grad, want, rtol=1e-5, atol=1e-5):
            raise AssertionError("world_size=1 gradient differs from the single-rank result")
