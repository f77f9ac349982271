"""Bitwise repeatability: repeated calls and fresh processes give identical bits."""

from __future__ import annotations

import textwrap

import torch
from gdn_core.testkit import assert_equal, make_inputs, run_fwd_bwd
from gdn_det_train import causal_conv1d_det, chunk_gated_delta_rule_det

LENGTHS = [1, 63, 64, 65, 150]


def test_repeat_calls_bitwise():
    inputs, cu, cot = make_inputs(LENGTHS, H=1, HV=2, seed=20, gate=True)
    first = run_fwd_bwd(chunk_gated_delta_rule_det, inputs, cu, cot, l2norm=True)
    for _ in range(2):
        assert_equal(first, run_fwd_bwd(chunk_gated_delta_rule_det, inputs, cu, cot,
                                        l2norm=True))


def test_conv1d_repeat_bitwise():
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(1, 3000, 24, generator=gen)  # several token blocks of the reduction
    w = torch.randn(24, 4, generator=gen)
    b = torch.randn(24, generator=gen)
    dy = torch.randn(1, 3000, 24, generator=gen)
    cu = [0, 1000, 1001, 3000]
    grads = []
    for _ in range(3):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = causal_conv1d_det(xs, ws, bs, "silu", cu)
        (y * dy).sum().backward()
        grads.append((y.detach(), xs.grad, ws.grad, bs.grad))
    for other in grads[1:]:
        for a, c in zip(grads[0], other):
            assert torch.equal(a, c)


_DIGEST_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from gdn_det_train import causal_conv1d_det, chunk_gated_delta_rule_det

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    lengths = [1, 63, 64, 65, 150]
    T, H, HV, K, V = sum(lengths), 1, 2, 16, 16
    cu = torch.tensor([0, 1, 64, 128, 193, 343])
    x = torch.randn(1, T, 2 * H * K + HV * V).requires_grad_()
    w = torch.randn(x.shape[-1], 4).requires_grad_()
    y = causal_conv1d_det(x, w, None, "silu", cu)
    q, k, v = y.split([H * K, H * K, HV * V], -1)
    q, k, v = q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, V)
    g = torch.randn(1, T, HV).requires_grad_()
    beta = torch.rand(1, T, HV).requires_grad_()
    A_log = torch.randn(HV).requires_grad_()
    dt_bias = torch.randn(HV).requires_grad_()
    h0 = torch.randn(len(lengths), HV, K, V).requires_grad_()
    o, ht = chunk_gated_delta_rule_det(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    do, dht = torch.randn(o.shape), torch.randn(ht.shape)
    ((o * do).sum() + (ht * dht).sum()).backward()
    named = dict(o=o, ht=ht, dx=x.grad, dw=w.grad, dg=g.grad, dbeta=beta.grad, dh0=h0.grad,
                 dA_log=A_log.grad, ddt_bias=dt_bias.grad)
    print(json.dumps({n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()
                                        .tobytes()).hexdigest() for n, t in named.items()}))
    """
)


def test_cross_process_bitwise(run_script):
    first, second = run_script(_DIGEST_SCRIPT, processes=2)
    assert set(first) == {"o", "ht", "dx", "dw", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"}
    assert first == second
