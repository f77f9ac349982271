"""torch.compile(fullgraph=True) of a small KCP GDN block (conv → GDN → projection).

Under ``torch.compile`` the package's differentiable calls route through its custom
ops (``torch.ops.<package>.kcp_*``); a context enters the graph as its handle tensor,
so a new plan's context reuses the compiled graph. Checked on the CPU reference
backend (deterministic there, whatever the package promises): worlds of one,
simulated worlds and a gloo world of two give eager's bits without a graph break
(eager runs the same bodies through an ``autograd.Function``); static (CUDA-graph)
contexts give the ordinary path's bits across layouts. Run on a KCP package by its
test module (``from … import *``) with its ``kcp_api`` and ``kcp_compile_worker`` (the
path of its gloo worker script) fixtures.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from gdn_core.kcp.testing import run_gloo_world
from gdn_core.suites import kcp_compile_block, torch_state
from gdn_core.suites.compare import all_equal

T = 192
LAYOUTS = ([0, 10, 130, 192], [0, 64, 65, 192], [0, 192])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test from an empty Dynamo cache and counters, under deterministic algorithms."""
    with torch_state.fresh_dynamo(deterministic_algorithms_on=True):
        yield


@pytest.fixture(scope="module")
def block(kcp_api):
    """:mod:`gdn_core.suites.kcp_compile_block` bound to this package's calls."""
    return kcp_compile_block.on(kcp_api)


_equal = all_equal
_no_graph_breaks = torch_state.no_graph_breaks


def test_world_of_one_compiled_is_eager_bitwise_one_graph(kcp_api, block):
    C = block
    compiled = torch.compile(C.rank_block, fullgraph=True, backend="aot_eager")
    params = C.make_params(T, seed=1)
    for offs in LAYOUTS:
        plan = kcp_api.partition(offs, 1)
        ctx = kcp_api.build_context(plan, 0, conv_kernel_size=C.W)
        got = C.rank_step(compiled, params, plan, 0, ctx)
        want = C.rank_step(C.rank_block, params, plan, 0, ctx)
        assert _equal(got, want), offs
    _no_graph_breaks()
    assert counters["stats"]["unique_graphs"] == 1  # no recompilation per context


@pytest.mark.parametrize("exchange", ["allgather", "ring"])
def test_simulated_world_compiled_is_eager_bitwise(kcp_api, block, exchange):
    C = block
    compiled = torch.compile(C.world_block, fullgraph=True, backend="aot_eager")
    params = C.make_params(T, seed=2)
    for offs in LAYOUTS[:2]:
        # "even" cuts: the shard shapes (the graph's input shapes) stay fixed
        plan = kcp_api.partition(offs, 3, boundary="even")
        ctxs = kcp_api.build_simulated_contexts(plan, conv_kernel_size=C.W)
        got = C.world_step(compiled, params, plan, ctxs, exchange)
        want = C.world_step(C.world_block, params, plan, ctxs, exchange)
        assert _equal(got, want), offs
    _no_graph_breaks()
    assert counters["stats"]["unique_graphs"] == 1


def test_gloo_world_of_two_compiled_is_eager_bitwise(kcp_compile_worker):
    res = run_gloo_world(2, kcp_compile_worker, "compile_worker",
                         {"layouts": [LAYOUTS[0], LAYOUTS[1]], "seed": 3,
                          "exchange": "allgather"})
    for r in res:
        assert r == {"equal": [True, True], "breaks": 0, "graphs": 1}, res


def test_inductor_world_of_one(kcp_api, block):
    C = block
    compiled = torch.compile(C.rank_block, fullgraph=True, backend="inductor")
    params = C.make_params(T, seed=4)
    plan = kcp_api.partition(LAYOUTS[0], 1)
    ctx = kcp_api.build_context(plan, 0)
    got = C.rank_step(compiled, params, plan, 0, ctx)
    want = C.rank_step(C.rank_block, params, plan, 0, ctx)
    for a, b in zip(got, want, strict=True):  # inductor may fuse the projection differently
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    _no_graph_breaks()


def test_static_context_follows_new_layouts_in_place(kcp_api, block):
    C = block
    params = C.make_params(T, seed=5)
    plan0 = kcp_api.partition(LAYOUTS[0], 1)
    static = kcp_api.build_context(plan0, 0, max_docs=4)
    buffers = (static._gdn_static_layout.cu_seqlens.data_ptr(),
               static._gdn_static_layout.index.chunk_start.data_ptr())
    compiled = torch.compile(C.rank_block, fullgraph=True, backend="aot_eager")
    for offs in LAYOUTS:
        plan = kcp_api.partition(offs, 1)
        kcp_api.update_context(static, plan)
        assert static.plan is not plan0 and static.local_offsets == tuple(offs)
        plain = kcp_api.build_context(plan, 0)
        want = C.rank_step(C.rank_block, params, plan, 0, plain)
        assert _equal(C.rank_step(C.rank_block, params, plan, 0, static), want), offs
        assert _equal(C.rank_step(compiled, params, plan, 0, static), want), offs
    assert (static._gdn_static_layout.cu_seqlens.data_ptr(),
            static._gdn_static_layout.index.chunk_start.data_ptr()) == buffers
    _no_graph_breaks()
    assert counters["stats"]["unique_graphs"] == 1
    with pytest.raises(ValueError, match="max_docs"):
        kcp_api.update_context(static, kcp_api.partition([0, 1, 2, 3, 4, T], 1))
    with pytest.raises(ValueError, match="T="):
        kcp_api.update_context(static, kcp_api.partition([0, T - 1], 1))
    from gdn_core.kcp_ops import attach_static_layout

    sim = kcp_api.build_simulated_contexts(kcp_api.partition([0, T], 2))
    with pytest.raises(ValueError, match="world_size == 1"):
        attach_static_layout(sim[0], max_docs=2)


def test_fake_implementations(kcp_api):
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = getattr(torch.ops, kcp_api.module)
    plan = kcp_api.partition([0, 50, 100], 1)
    ctx = kcp_api.build_context(plan, 0)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 100, 1, 16, generator=gen), torch.randn(1, 100, 1, 16, generator=gen)
    v = torch.randn(1, 100, 2, 16, generator=gen)
    g, beta = -torch.rand(1, 100, 2, generator=gen), torch.rand(1, 100, 2, generator=gen)
    h = ctx._gdn_op_handle
    args = (q, k, v, g, beta, h, None, None, True, "allgather", None)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(ops.kcp_chunk_gated_delta_rule, args, test_utils=utils)
    x, w = torch.randn(1, 100, 6, generator=gen), torch.randn(6, 4, generator=gen)
    torch.library.opcheck(ops.kcp_causal_conv1d, (x, w, None, h, "silu"), test_utils=utils)
    with FakeTensorMode() as mode:
        o, token = ops.kcp_chunk_gated_delta_rule(
            *(mode.from_tensor(t) for t in (q, k, v, g, beta, h)), None, None, True,
            "allgather", None)
        assert o.shape == v.shape and token.shape == () and token.device.type == "cpu"
