"""GPU tests (``pytest -m gpu``): compiled KCP blocks on the Triton kernels, and a
training step captured in a CUDA graph and replayed for new document layouts.

* The KCP block (conv → GDN → projection, :mod:`gdn_core.suites.kcp_compile_block`)
  under ``torch.compile(fullgraph=True)`` — a world of one and a simulated world of
  three on one GPU — without a graph break. Deterministic package: eager's bits
  (``aot_eager``) / eager's values (``inductor``, which may fuse the projection and
  the loss differently), each repeating its own bits. The other package: eager's
  values (``aot_eager``; it promises no bits).
* A whole training step (forward, loss, backward) of a *static* world-of-one
  context (``build_context…(..., max_docs=...)``) is captured once in a CUDA graph;
  for each new batch the inputs are copied into the captured tensors and the
  package's ``update_context`` copies the new plan's layout into the context's
  device tables; the replayed step must give the bits (deterministic) or the values
  of an eager step with an ordinary context of that plan.

Run on a KCP package by its test module (``from … import *``) with its ``kcp_api``
fixture.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from gdn_core.suites import kcp_compile_block
from gdn_core.suites.compare import all_equal, assert_all_close_bf16
from gdn_core.suites.gpu_marks import ONE_GPU
from gdn_core.suites.torch_state import fresh_dynamo, no_graph_breaks

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = ONE_GPU

# every document at most one segment long (1024 tokens): the ordinary path's
# default segments and the static context's plain path then agree
T = 1024
LAYOUTS = ([0, 100, 700, 1024], [0, 300, 301, 900, 1000, 1024], [0, 1024])


@pytest.fixture(autouse=True)
def _fresh(kcp_api):
    with fresh_dynamo(kcp_api.deterministic):
        yield


@pytest.fixture(scope="module")
def block(kcp_api):
    """The block on this package's calls."""
    return kcp_compile_block.on(kcp_api)


def _agree(bitwise: bool, got: list, want: list, what: object) -> None:
    if bitwise:
        assert all_equal(got, want), what
    else:
        assert_all_close_bf16(got, want)


def test_compiled_world_of_one_on_triton(kcp_api, block):
    C, det = block, kcp_api.deterministic
    params = C.make_params(T, seed=1, device="cuda", dtype=torch.bfloat16)
    # inductor on the non-deterministic package: see gdn-det-train-kcp's gpu tests
    for backend in ("aot_eager", "inductor") if det else ("aot_eager",):
        torch._dynamo.reset()
        compiled = torch.compile(C.rank_block, fullgraph=True, backend=backend)
        for offs in LAYOUTS:
            plan = kcp_api.partition(offs, 1)
            ctx = kcp_api.build_context(plan, 0, device="cuda")
            got = C.rank_step(compiled, params, plan, 0, ctx)
            if det:
                again = C.rank_step(compiled, params, plan, 0, ctx)
                assert all_equal(got, again), (backend, offs)  # deterministic
            want = C.rank_step(C.rank_block, params, plan, 0, ctx)
            _agree(det and backend == "aot_eager", got, want, offs)
        no_graph_breaks()


def test_compiled_simulated_world_on_triton(kcp_api, block):
    C = block
    params = C.make_params(T, seed=2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(C.world_block, fullgraph=True, backend="aot_eager")
    for offs in LAYOUTS[:2]:
        plan = kcp_api.partition(offs, 3, boundary="even")
        ctxs = kcp_api.build_simulated_contexts(plan, device="cuda")
        for exchange in ("allgather", "ring"):
            got = C.world_step(compiled, params, plan, ctxs, exchange)
            want = C.world_step(C.world_block, params, plan, ctxs, exchange)
            _agree(kcp_api.deterministic, got, want, (offs, exchange))
    no_graph_breaks()


class _Step:
    """A training step over static tensors: ``run()`` = forward, loss, backward."""

    def __init__(self, params: dict, context: Any, body: Any):
        self.data = {n: params[n].clone() for n in ("x", "g", "beta")}
        for t in self.data.values():
            t.requires_grad_()
        self.weights = {n: params[n].clone().requires_grad_() for n in ("w", "b", "P")}
        self.context = context
        self.body = body
        self.out = None

    def leaves(self) -> list:
        return [*self.data.values(), *self.weights.values()]

    def run(self) -> None:
        d, w = self.data, self.weights
        out = self.body(d["x"], d["g"], d["beta"], w["w"], w["b"], w["P"], self.context,
                        "allgather")
        (out * out).sum().backward()  # the loss of kcp_compile_block.rank_step
        self.out = out.detach()

    def results(self) -> list:
        return [self.out.clone()] + [t.grad.clone() for t in self.leaves()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_cuda_graph_training_step_replays_new_layouts(kcp_api, block, compiled):
    C = block
    dtype = torch.bfloat16
    body = C.rank_block
    if compiled:
        body = torch.compile(C.rank_block, fullgraph=True, backend="aot_eager")
    plans = [kcp_api.partition(offs, 1) for offs in LAYOUTS]
    ctx = kcp_api.build_context(plans[0], 0, device="cuda", max_docs=8)
    batches = [C.make_params(T, seed=10 + i, device="cuda", dtype=dtype)
               for i in range(len(LAYOUTS))]
    step = _Step(batches[0], ctx, body)

    # warm up (Triton compilation, cuBLAS handles) on a side stream, then capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step.run()
    torch.cuda.current_stream().wait_stream(side)
    for t in step.leaves():
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()

    for plan, batch in zip(plans, batches):
        kcp_api.update_context(ctx, plan)  # new tables, same device buffers
        with torch.no_grad():
            for n, t in step.data.items():
                t.copy_(batch[n])
            for n, t in step.weights.items():
                t.copy_(batch[n])
        graph.replay()
        torch.cuda.synchronize()
        got = step.results()
        plain = kcp_api.build_context(plan, 0, device="cuda")
        want = C.rank_step(C.rank_block, batch, plan, 0, plain)
        if kcp_api.deterministic:
            assert torch.equal(got[0], want[0]), plan.offsets
            assert all_equal(got[1:], want[1:]), plan.offsets
        else:
            assert_all_close_bf16(got, want)
