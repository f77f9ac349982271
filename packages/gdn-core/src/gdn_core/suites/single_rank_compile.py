"""torch.compile(fullgraph=True) of a small GDN block: short conv → GDN → projection.

The public calls route through the package's custom ops
(``torch.ops.<package>.*``), so Dynamo traces the block without a graph
break and AOTAutograd differentiates through the registered backward. On the
CPU reference backend (and, in a subprocess, the Triton interpreter) the
compiled block must give eager's bits (both are deterministic here, whatever
the package promises), for several document layouts and without recompiling
per layout.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters

from gdn_core import testkit
from gdn_core.layout import VarlenLayout
from gdn_core.suites import torch_state
from gdn_core.suites.block_params import block_params
from gdn_core.train_ops import SAVED_OUTPUTS

T, H, HV, K, V, W = 96, 1, 2, 16, 16, 4
D = 2 * H * K + HV * V
LAYOUTS = ([0, 10, 70, 96], [0, 50, 51, 96], [0, 1, 2, 96])  # same document count
VARIED = ([0, 10, 70, 96], [0, 96], [0, 5, 6, 7, 96])


def make_params(seed=0):
    return block_params(T, D, HV, V, W, seed=seed, proj_rows=8, proj_scale=0.2)


def make_block(api):
    """The block, calling the package's conv and GDN."""

    def block(x, g, beta, w, b, P, cu):
        y = api.conv(x, w, b, "silu", cu)
        q, k, v = y.split([H * K, H * K, HV * V], dim=-1)
        o, ht = api.autograd(
            q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, V), g, beta,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True, output_final_state=True)
        return o.reshape(1, T, HV * V) @ P.T, ht

    return block


def step(fn, params, cu, docs):
    leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    out, ht = fn(*leaves.values(), cu)
    loss = (out * out).sum() + ht[:docs].square().sum()
    loss.backward()
    return [out.detach(), ht[:docs].detach()] + [t.grad for t in leaves.values()]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts from an empty Dynamo cache and counters."""
    with torch_state.fresh_dynamo(deterministic_algorithms_on=False):
        yield


no_graph_breaks = torch_state.no_graph_breaks


def test_compiled_block_is_eager_bitwise_one_graph_for_every_layout(api):
    block = make_block(api)
    params = make_params()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for offs in LAYOUTS:
        # host offsets: no sync; a graph input, so no recompilation (another document
        # count is another shape: use a VarlenLayout to keep it fixed)
        cu = torch.tensor(offs, dtype=torch.int32)
        got = step(compiled, params, cu, len(offs) - 1)
        want = step(block, params, cu, len(offs) - 1)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), offs
    no_graph_breaks()
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_block_with_fixed_size_layouts(api):
    block = make_block(api)
    params = make_params(1)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    reused = VarlenLayout(VARIED[0], max_docs=4)
    for offs in VARIED:
        reused.update(offs)  # the same buffers, the next batch's documents
        fresh = VarlenLayout(offs, max_docs=4)  # a new object of the same capacities
        want = step(block, params, torch.tensor(offs), len(offs) - 1)
        for lay in (reused, fresh):
            got = step(compiled, params, lay, len(offs) - 1)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), offs
    no_graph_breaks()
    assert counters["stats"]["unique_graphs"] == 1


def test_dynamo_explain_reports_no_break(api):
    block = make_block(api)
    p = make_params(2)
    cu = torch.tensor(LAYOUTS[0])
    explained = torch._dynamo.explain(block)(*p.values(), cu)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    names = {str(n.target) for g in explained.graphs for n in g.graph.nodes
             if n.op == "call_function"}
    assert any(f"{api.module}.chunk_gated_delta_rule" in n for n in names), names
    assert any(f"{api.module}.causal_conv1d" in n for n in names), names


def test_inductor_compiled_block(api):
    block = make_block(api)
    params = make_params(3)
    compiled = torch.compile(block, fullgraph=True, backend="inductor")
    cu = torch.tensor(LAYOUTS[0])
    got = step(compiled, params, cu, 3)
    want = step(block, params, cu, 3)
    for a, b in zip(got, want):  # inductor may fuse the projection/loss differently
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    no_graph_breaks()


def test_fake_implementations(api):
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = getattr(torch.ops, api.module)
    p = make_params(4)
    q, k = p["x"][..., :K].reshape(1, T, H, K), p["x"][..., K:2 * K].reshape(1, T, H, K)
    v = p["x"][..., 2 * K:].reshape(1, T, HV, V).contiguous()
    q, k = q.contiguous(), k.contiguous()
    cu = torch.tensor(LAYOUTS[0])
    args = (q, k, v, p["g"], p["beta"], None, None, None, cu, None, None, None, True, True,
            False, None, None)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(ops.chunk_gated_delta_rule, args, test_utils=utils)
    torch.library.opcheck(ops.causal_conv1d, (p["x"], p["w"], p["b"], None, cu, None, "silu"),
                          test_utils=utils)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        o, final, *saved = ops.chunk_gated_delta_rule(*fake)
        assert o.shape == (1, T, HV, V) and final.shape == (3, HV, K, V)
        assert final.dtype == torch.float32
        # what the backward reads comes back as outputs (no token, no stash)
        assert len(saved) == len(SAVED_OUTPUTS) and all(t.device == o.device for t in saved)
        y = ops.causal_conv1d(mode.from_tensor(p["x"]), mode.from_tensor(p["w"]), None,
                              None, None, None, "silu")
        assert y.shape == p["x"].shape


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, torch
    from gdn_core.layout import VarlenLayout
    from gdn_core.suites.single_rank_compile import LAYOUTS, make_block, make_params, step
    block = make_block(importlib.import_module(sys.argv[1] + ".ops").API)
    params = make_params(5)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    lay = VarlenLayout(LAYOUTS[0], max_docs=4)
    equal = []
    for offs in LAYOUTS[:2]:
        lay.update(offs)
        got = step(compiled, params, lay, len(offs) - 1)
        want = step(block, params, torch.tensor(offs), len(offs) - 1)
        equal.append(all(torch.equal(a, b) for a, b in zip(got, want)))
    from torch._dynamo.utils import counters
    print(json.dumps({"equal": equal, "breaks": len(counters["graph_break"]),
                      "graphs": counters["stats"]["unique_graphs"]}))
    """
)


def test_compiled_block_on_the_triton_interpreter(api):
    # the real kernels (fixed-size tables for the layout, exact tables for eager)
    # the package is loaded already (its api fixture): gdn_core imports no package
    (res,) = testkit.run_script(_INTERPRETER_SCRIPT, api.module, timeout=600,
                                TRITON_INTERPRET="1", package=sys.modules[api.module])
    assert res == {"equal": [True, True], "breaks": 0, "graphs": 1}
