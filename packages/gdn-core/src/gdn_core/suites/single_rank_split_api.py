"""The split API (forward / backward) equals the autograd path."""

from __future__ import annotations

import pytest
import torch

from gdn_core.testkit import assert_equal, make_inputs, run_fwd_bwd


def split_fwd_bwd(api, inputs, cu, cot, *, l2norm=False, output_final_state=True, workspace=None):
    gate = inputs["A_log"] is not None
    extra = dict(use_gate_in_kernel=True, A_log=inputs["A_log"],
                 dt_bias=inputs["dt_bias"]) if gate else {}
    o, ht, saved = api.fwd(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
        initial_state=inputs["initial_state"], output_final_state=output_final_state,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm, **extra,
    )
    dht = cot["dht"] if output_final_state else None
    grads = api.bwd(saved, cot["do"], dht, workspace=workspace)
    return o, ht, saved, grads


def as_result(o, ht, grads):
    return {"o": o, "ht": ht, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv, "dg": grads.dg,
            "dbeta": grads.dbeta, "dinitial_state": grads.dh0, "dA_log": grads.dA_log,
            "ddt_bias": grads.ddt_bias}


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
def test_split_equals_autograd(api, gate, l2norm):
    inputs, cu, cot = make_inputs([3, 64, 70], H=1, HV=2, seed=10, gate=gate)
    o, ht, saved, grads = split_fwd_bwd(api, inputs, cu, cot, l2norm=l2norm)
    assert isinstance(saved, api.saved_cls) and isinstance(grads, api.grads_cls)
    assert saved.deterministic is api.deterministic and saved.mode == api.mode
    assert saved.use_gate_in_kernel == gate
    auto = run_fwd_bwd(api.autograd, inputs, cu, cot, l2norm=l2norm)
    assert_equal(as_result(o, ht, grads), auto)


def test_without_initial_state_or_final_state(api):
    inputs, cu, cot = make_inputs(B=2, T=40, initial_state=False, seed=11)
    o, ht, saved, grads = split_fwd_bwd(api, inputs, cu, cot, output_final_state=False)
    assert ht is None and grads.dh0 is None and grads.dA_log is None
    auto = run_fwd_bwd(api.autograd, inputs, cu, cot, output_final_state=False)
    assert_equal(as_result(o, ht, grads), auto)


def test_saved_set_reusable_and_no_graph(api):
    inputs, cu, cot = make_inputs([50], seed=12, gate=True)
    leaves = {n: (x.clone().requires_grad_() if x is not None else None)
              for n, x in inputs.items()}
    o, _, saved, first = split_fwd_bwd(api, leaves, cu, cot)
    assert not o.requires_grad  # the split forward records no graph
    second = api.bwd(saved, cot["do"], cot["dht"])
    for name, a in first.as_dict().items():
        assert torch.equal(a, getattr(second, name)), name
    assert f"{api.saved_cls.__name__}({api.mode}" in repr(saved)
