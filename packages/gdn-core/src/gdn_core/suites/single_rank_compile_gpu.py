"""GPU tests (``pytest -m gpu``): the compiled block on the Triton kernels, and a
training step captured in a CUDA graph replayed for new document layouts.

* ``torch.compile(fullgraph=True)`` of conv → GDN → projection, without a graph
  break. Deterministic package: ``aot_eager`` gives eager's bits, ``inductor``
  eager's values (it may fuse the projection and the loss differently) and both
  repeat their own bits; a :class:`~gdn_core.layout.VarlenLayout` gives the bits of
  plain ``cu_seqlens`` with ``segment_size=0`` (a layout runs without segments).
  Non-deterministic package: ``aot_eager`` gives eager's values, and a layout
  agrees with plain ``cu_seqlens`` (the segment path) within tolerance.
* With a layout (fixed-size device tables), a whole step is captured once; per
  batch the inputs are copied into the captured tensors and ``layout.update(...)``
  copies the new documents into the same tables; the replay must give the bits
  (deterministic: of an eager step with ``segment_size=0``) or the values of an
  eager step with plain ``cu_seqlens``.

Run on a single-rank package through its ``api`` fixture.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gdn_core.layout import VarlenLayout
from gdn_core.suites.block_params import block_params
from gdn_core.suites.compare import all_equal, assert_all_close_bf16
from gdn_core.suites.gpu_marks import ONE_GPU
from gdn_core.suites.torch_state import fresh_dynamo, no_graph_breaks

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = ONE_GPU

T, H, HV, K, V, W = 2048, 2, 4, 128, 128, 4
D = 2 * H * K + HV * V
LAYOUTS = ([0, 100, 1000, 2048], [0, 700, 701, 1500, 1999, 2048], [0, 2048])


def make_params(seed: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    p = block_params(T, D, HV, V, W, seed=seed, proj_rows=256, proj_scale=0.05)
    return {n: t.to("cuda", dtype) for n, t in p.items()}


def block_of(api: Any) -> Callable:
    """conv → GDN → projection on ``api``'s calls."""

    def block(x, g, beta, w, b, P, cu, seg=None):
        y = api.conv(x, w, b, "silu", cu)
        q, k, v = y.split([H * K, H * K, HV * V], dim=-1)
        o, _ = api.autograd(
            q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, V), g, beta,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True, segment_size=seg)
        return o.reshape(1, T, HV * V) @ P.T

    return block


def step(fn: Callable, params: dict, cu: Any, seg: int | None = None) -> list:
    leaves = [t.clone().requires_grad_() for t in params.values()]
    out = fn(*leaves, cu, seg)
    (out * out).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.fixture(autouse=True)
def _fresh():
    with fresh_dynamo(deterministic_algorithms_on=True):
        yield


def _agree(a: list, b: list, tol: float = 1e-2) -> None:
    """Also by the accuracy contract's measure (norm of the difference over the
    norm of the value): a layout runs the plain chunk recurrence, plain
    ``cu_seqlens`` the segment path (segment_size 1024), and this names the
    tensor (index) and the size of a disagreement."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x, y = x.float(), y.float()
        err = ((x - y).norm() / y.norm().clamp_min(1e-12)).item()
        assert err <= tol, (i, err)


def test_compiled_block_on_triton(api):
    block = block_of(api)
    params = make_params(0)
    # inductor on the non-deterministic package: see gdn-det-train's gpu tests
    for backend in ("aot_eager", "inductor") if api.deterministic else ("aot_eager",):
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        for offs in LAYOUTS:
            cu = torch.tensor(offs, dtype=torch.int32)  # host offsets (CPU): no sync
            got = step(compiled, params, cu)
            want = step(block, params, cu)
            if api.deterministic:
                assert all_equal(got, step(compiled, params, cu)), (backend, offs)
            if api.deterministic and backend == "aot_eager":
                assert all_equal(got, want), offs
            else:
                assert_all_close_bf16(got, want)
            lay = VarlenLayout(offs, device="cuda", max_docs=8)  # runs segment_size=0
            with_layout = step(compiled, params, lay)
            if api.deterministic:
                plain = step(compiled, params, cu, 0)
                assert all_equal(with_layout, plain), (backend, offs)
            else:
                _agree(with_layout, got)
                assert_all_close_bf16(with_layout, got)
        no_graph_breaks()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_cuda_graph_training_step_replays_new_layouts(api, compiled):
    block = block_of(api)
    fn = torch.compile(block, fullgraph=True, backend="aot_eager") if compiled else block
    batches = [make_params(10 + i) for i in range(len(LAYOUTS))]
    layout = VarlenLayout(LAYOUTS[0], device="cuda", max_docs=8)
    static = {n: t.clone().requires_grad_() for n, t in batches[0].items()}

    def run():
        out = fn(*static.values(), layout, None)
        (out * out).sum().backward()
        return out.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    for t in static.values():
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()

    for offs, batch in zip(LAYOUTS, batches):
        layout.update(offs)
        with torch.no_grad():
            for n, t in static.items():
                t.copy_(batch[n])
        graph.replay()
        torch.cuda.synchronize()
        got = [out.clone()] + [t.grad.clone() for t in static.values()]
        if api.deterministic:
            want = step(block, batch, torch.tensor(offs), 0)
            assert all_equal(got, want), offs
        else:
            want = step(block, batch, torch.tensor(offs))
            _agree(got, want)
            assert_all_close_bf16(got, want)
