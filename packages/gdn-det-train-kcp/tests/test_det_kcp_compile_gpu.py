"""GPU tests (``pytest -m gpu``): compiled blocks on the Triton kernels, and a
training step captured in a CUDA graph and replayed for new document layouts.

* The KCP block (conv → GDN → projection) under ``torch.compile(fullgraph=
  True)`` — a world of one and a simulated world of three on one GPU — gives
  eager's bits (``aot_eager``) / eager's values (``inductor``, which may fuse
  the projection and the loss differently), without a graph break.
* A whole training step (forward, loss, backward) of a *static* world-of-one
  context (``build_context_det_kcp(..., max_docs=...)``) is captured once in a
  CUDA graph; for each new batch the inputs are copied into the captured
  tensors and :func:`update_context_det_kcp` copies the new plan's layout into
  the context's device tables; the replayed step must give the bits of an
  eager step with an ordinary context of that plan.
"""

from __future__ import annotations

import os

import gdn_det_train_kcp as kcp
import pytest
import torch
from gdn_core.suites import kcp_compile_block
from torch._dynamo.utils import counters

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

C = kcp_compile_block.on(kcp.ops.API)  # the block on this package's calls

# every document at most one segment long (1024 tokens): the ordinary path's
# default segments and the static context's plain path then agree
T = 1024
LAYOUTS = ([0, 100, 700, 1024], [0, 300, 301, 900, 1000, 1024], [0, 1024])


@pytest.fixture(autouse=True)
def _fresh():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(before)


def _equal(got, want):
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_compiled_world_of_one_on_triton(dtype=torch.bfloat16):
    params = C.make_params(T, seed=1, device="cuda", dtype=dtype)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(C.rank_block, fullgraph=True, backend=backend)
        for offs in LAYOUTS:
            plan = kcp.partition_det_kcp(offs, 1)
            ctx = kcp.build_context_det_kcp(plan, 0, device="cuda")
            got = C.rank_step(compiled, params, plan, 0, ctx)
            again = C.rank_step(compiled, params, plan, 0, ctx)
            want = C.rank_step(C.rank_block, params, plan, 0, ctx)
            assert _equal(got, again), (backend, offs)  # deterministic
            if backend == "aot_eager":
                assert _equal(got, want), offs
            else:
                for a, b in zip(got, want, strict=True):
                    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_simulated_world_on_triton():
    params = C.make_params(T, seed=2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(C.world_block, fullgraph=True, backend="aot_eager")
    for offs in LAYOUTS[:2]:
        plan = kcp.partition_det_kcp(offs, 3, boundary="even")
        ctxs = kcp.build_simulated_contexts_det_kcp(plan, device="cuda")
        for exchange in ("allgather", "ring"):
            got = C.world_step(compiled, params, plan, ctxs, exchange)
            want = C.world_step(C.world_block, params, plan, ctxs, exchange)
            assert _equal(got, want), (offs, exchange)
    assert not counters["graph_break"], dict(counters["graph_break"])


class _Step:
    """A training step over static tensors: ``run()`` = forward, loss, backward."""

    def __init__(self, params: dict, context, body):
        self.data = {n: params[n].clone() for n in ("x", "g", "beta")}
        for t in self.data.values():
            t.requires_grad_()
        self.weights = {n: params[n].clone().requires_grad_() for n in ("w", "b", "P")}
        self.context = context
        self.body = body
        self.out = None

    def leaves(self):
        return [*self.data.values(), *self.weights.values()]

    def run(self):
        d, w = self.data, self.weights
        out = self.body(d["x"], d["g"], d["beta"], w["w"], w["b"], w["P"], self.context,
                        "allgather")
        (out * out).sum().backward()  # the loss of kcp_compile_block.rank_step
        self.out = out.detach()

    def results(self):
        return [self.out.clone()] + [t.grad.clone() for t in self.leaves()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_cuda_graph_training_step_replays_new_layouts(compiled):
    dtype = torch.bfloat16
    body = C.rank_block
    if compiled:
        body = torch.compile(C.rank_block, fullgraph=True, backend="aot_eager")
    plans = [kcp.partition_det_kcp(offs, 1) for offs in LAYOUTS]
    ctx = kcp.build_context_det_kcp(plans[0], 0, device="cuda", max_docs=8)
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
        kcp.update_context_det_kcp(ctx, plan)  # new tables, same device buffers
        with torch.no_grad():
            for n, t in step.data.items():
                t.copy_(batch[n])
            for n, t in step.weights.items():
                t.copy_(batch[n])
        graph.replay()
        torch.cuda.synchronize()
        got = step.results()
        plain = kcp.build_context_det_kcp(plan, 0, device="cuda")
        want = C.rank_step(C.rank_block, batch, plan, 0, plain)
        assert torch.equal(got[0], want[0]), plan.offsets
        assert _equal(got[1:], want[1:]), plan.offsets
