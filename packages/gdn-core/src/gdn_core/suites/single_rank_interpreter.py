"""The Triton path on CPU: the real kernels under TRITON_INTERPRET=1, in a fresh
process (the variable must be set before triton is imported), small fp32 problem
against the fp32 oracle, and a later step through the same workspace leaves the
earlier gradients alone. A second run must give the same bits (deterministic
package; also the same bits for row-strided input views, the segment path, as for
copies) or the oracle's values again (the other one). Run on a single-rank package
through its ``api`` and ``package`` (the imported module, which the child imports)
fixtures.
"""

from __future__ import annotations

import textwrap
from types import ModuleType
from typing import Any

from gdn_core.testkit import run_script

_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    import torch.nn.functional as F
    from gdn_core.reference import naive_recurrent_gdn
    from __PACKAGE__.ops import API

    DETERMINISTIC = __DETERMINISTIC__

    torch.manual_seed(0)
    lengths = [5, 64, 70]
    T, H, HV, K, V = sum(lengths), 1, 2, 16, 32
    cu = torch.tensor([0, 5, 69, 139], dtype=torch.int32)
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v = torch.randn(1, T, HV, V)
    g = torch.randn(1, T, HV)
    beta = torch.rand(1, T, HV)
    A_log, dt_bias = torch.rand(HV) - 0.5, torch.rand(HV) - 0.5
    h0 = torch.randn(3, HV, K, V)
    do, dht = torch.randn(1, T, HV, V), torch.randn(3, HV, K, V)
    ws = API.workspace_cls.for_shapes(T=T, H=H, HV=HV, K=K, V=V, num_docs=3, device="cpu",
                                      dtype=torch.float32)

    def run(fn, scale=1.0):
        xs = [(t * scale).requires_grad_() for t in (q, k, v, g, beta, h0, A_log, dt_bias)]
        o, ht = fn(*xs)
        ((o * do).sum() + (ht * dht).sum()).backward()
        return [o.detach(), ht.detach()] + [x.grad for x in xs]

    def kernel(q, k, v, g, beta, h0, A_log, dt_bias):
        return API.autograd(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
            dt_bias=dt_bias, workspace=ws)

    def oracle(q, k, v, g, beta, h0, A_log, dt_bias):
        gg = -A_log.exp() * F.softplus(g + dt_bias)
        return naive_recurrent_gdn(q, k, v, gg, beta, initial_state=h0,
                                   output_final_state=True, cu_seqlens=cu,
                                   use_qk_l2norm_in_kernel=True)

    def kernel_seg(q, k, v, g, beta, h0, A_log, dt_bias):  # 64-token segments
        return API.autograd(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
            dt_bias=dt_bias, segment_size=64)

    def run_views(fn):
        # q, k, v, g, beta as a model passes them: row-strided views of wider tensors
        ins = (q, k, v, g, beta)
        base = [torch.cat([t, torch.zeros_like(t)], -1).requires_grad_() for t in ins]
        rest = [t.clone().requires_grad_() for t in (h0, A_log, dt_bias)]
        views = [b[..., : t.shape[-1]] for b, t in zip(base, (q, k, v, g, beta))]
        o, ht = fn(*views, *rest)
        ((o * do).sum() + (ht * dht).sum()).backward()
        grads = [b.grad[..., : t.shape[-1]] for b, t in zip(base, (q, k, v, g, beta))]
        return [o.detach(), ht.detach()] + grads + [x.grad for x in rest]

    got = run(kernel)
    snapshot = [t.clone() for t in got]
    run(kernel, scale=0.5)  # another step through the same workspace
    unchanged = all(torch.equal(a, b) for a, b in zip(got, snapshot))
    again, ref = run(kernel), run(oracle)
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"]
    result = {
        "unchanged": unchanged,
        "rel": {n: ((a - b).norm() / b.norm()).item() for n, a, b in zip(names, got, ref)},
    }
    if DETERMINISTIC:
        result["equal"] = all(torch.equal(a, b) for a, b in zip(got, again))
        result["views_equal"] = all(torch.equal(a, b) for a, b in zip(run_views(kernel_seg),
                                                                      run(kernel_seg)))
    else:
        result["again"] = {n: ((a - b).norm() / b.norm()).item()
                           for n, a, b in zip(names, again, ref)}
    print(json.dumps(result))
    """
)


def interpreter_script(api: Any) -> str:
    """The child's script, on ``api``'s package and mode."""
    return (_SCRIPT.replace("__PACKAGE__", api.module)
            .replace("__DETERMINISTIC__", repr(api.deterministic)))


def test_triton_interpreter_matches_reference(api, package: ModuleType):
    (result,) = run_script(interpreter_script(api), package=package, timeout=900,
                           TRITON_INTERPRET="1")
    assert result["unchanged"], "a later step through the workspace changed earlier gradients"
    bad = {n: e for n, e in result["rel"].items() if not e < 1e-4}
    assert not bad, f"relative errors above 1e-4: {bad}"
    if api.deterministic:
        assert result["equal"], "two interpreter runs gave different bits"
        assert result["views_equal"], "strided views of a projection gave other bits than copies"
    else:
        bad = {n: e for n, e in result["again"].items() if not e < 1e-4}
        assert not bad, f"second run: relative errors above 1e-4: {bad}"
