"""A workspace allocated once serves every step of a training loop."""

from __future__ import annotations

import torch

from gdn_core.testkit import make_inputs


def _step(api, seed, lengths, workspace):
    inputs, cu, cot = make_inputs(lengths, seed=seed, gate=True)
    _, _, saved = api.fwd(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
        initial_state=inputs["initial_state"], output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
    )
    return api.bwd(saved, cot["do"], cot["dht"], workspace=workspace).as_dict()


def test_reuse_over_steps_identical(api):
    # sized for the largest step; steps of other layouts reuse it
    ws = api.workspace_cls.for_shapes(T=300, H=1, HV=2, K=16, V=16, num_docs=4, device="cpu",
                                 dtype=torch.float32)
    layouts = [[100, 200], [1, 64, 65, 170], [300], [100, 200]]
    for seed, lengths in enumerate(layouts):
        with_ws = _step(api, seed, lengths, ws)
        again = _step(api, seed, lengths, ws)
        without = _step(api, seed, lengths, None)
        for name, a in with_ws.items():
            assert torch.equal(a, again[name]), (seed, name)
            assert torch.equal(a, without[name]), (seed, name)


def test_for_inputs_and_autograd_path(api):
    inputs, cu, cot = make_inputs([30, 90], seed=7)
    ws = api.workspace_cls.for_inputs(inputs["q"], inputs["v"], cu)
    assert ws.capacity["tokens"] == 120 and ws.capacity["docs"] == 2
    assert ws.capacity["chunks"] >= 3 and ws.device == torch.device("cpu")
    results = []
    for _ in range(3):
        leaves = {n: x.clone().requires_grad_() for n, x in inputs.items() if x is not None}
        o, _ = api.autograd(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                          leaves["beta"], cu_seqlens=cu, workspace=ws)
        (o * cot["do"]).sum().backward()
        results.append([leaves[n].grad for n in ("q", "k", "v", "g", "beta")])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_capacity_bound_covers_worst_layout(api):
    # 1-token documents: one chunk each; the chunk capacity bound must hold them
    ws = api.workspace_cls.for_shapes(T=10, H=1, HV=2, K=16, V=16, num_docs=10, device="cpu")
    assert ws.capacity["chunks"] >= 10
    inputs, cu, cot = make_inputs([1] * 10, seed=8)
    _, _, saved = api.fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                                    inputs["beta"], cu_seqlens=cu)
    api.bwd(saved, cot["do"], workspace=ws)
