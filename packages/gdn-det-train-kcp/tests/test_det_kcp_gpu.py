"""GPU tests (``pytest -m gpu``): the Triton path in a simulated world on one GPU.

One H200 cannot host several NCCL ranks, so these run every rank of a world
in one process (``*_simulated``), which executes exactly the per-rank code of
a distributed run (docs/context-parallel.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import gdn_det_train_kcp as kcp
import pytest
import torch
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.conv1d import causal_conv1d
from gdn_core.suites.gpu_marks import ONE_GPU
from gdn_core.suites.kcp_mode import GRADS
from gdn_core.suites.kcp_mode import relative_error as rel_err
from gdn_core.suites.kcp_run import gpu_inputs as make
from gdn_core.suites.torch_state import deterministic_algorithms

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = ONE_GPU

LAYOUTS = [
    # (offsets, world, boundary)
    ([0, 4096], 4, "chunk"),                              # one document over four ranks
    ([0, 700, 701, 3000, 3100, 4000], 3, "even"),         # cuts off the chunk grid
    ([0, 100, 2100, 2101, 4096], 8, "doc"),               # doc policy, several pass-throughs
    ([0, 200], 4, "chunk"),                               # an empty rank inside a document
]


@pytest.fixture(autouse=True)
def _deterministic():
    with deterministic_algorithms(True):
        yield


def single(ins, offsets, l2=True):
    o, _, saved = chunk_gdn_fwd(*ins[:5], cu_seqlens=offsets, deterministic=True,
                                use_qk_l2norm_in_kernel=l2)
    return o, chunk_gdn_bwd(saved, ins[5], deterministic=True)


def simulate(ins, plan, exchange, l2=True, workspaces=None):
    ctxs = kcp.build_simulated_contexts_det_kcp(plan, device="cuda")
    sh = [[t[:, slice(*plan.token_range(r))].contiguous() for r in range(plan.world_size)]
          for t in ins]
    os_, saveds = kcp.chunk_gdn_det_fwd_kcp_simulated(*sh[:5], ctxs, exchange=exchange,
                                                      use_qk_l2norm_in_kernel=l2)
    assert all(s.backend == "triton" for s in saveds)
    grads = kcp.chunk_gdn_det_bwd_kcp_simulated(saveds, sh[5], workspaces)
    return torch.cat(os_, 1), {n: torch.cat([getattr(g, n) for g in grads], 1) for n in GRADS}


@contextmanager
def _tf32(allowed: bool) -> Iterator[None]:
    """fp32 matmuls with TF32 allowed ("medium" precision) or not ("highest")."""
    prec = torch.get_float32_matmul_precision()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.set_float32_matmul_precision("medium" if allowed else "highest")
        torch.backends.cuda.matmul.allow_tf32 = allowed
        yield
    finally:
        torch.set_float32_matmul_precision(prec)
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _same_bits_with_and_without_tf32(ins, plan, exchange_with_tf32):
    """The world without TF32 (allgather) and with it (``exchange_with_tf32``): the
    same bits; returns the first run."""
    with _tf32(False):
        a = simulate(ins, plan, "allgather")
    with _tf32(True):
        b = simulate(ins, plan, exchange_with_tf32)
    assert torch.equal(a[0], b[0])
    for n in GRADS:
        assert torch.equal(a[1][n], b[1][n]), n
    return a


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("offsets,world,boundary", LAYOUTS)
def test_simulated_world_matches_single_gpu(offsets, world, boundary, dtype, tol):
    ins = make(offsets, dtype=dtype)
    o_ref, g_ref = single(ins, offsets)
    plan = kcp.partition_det_kcp(offsets, world, boundary=boundary)
    ws = [kcp.DetKCPWorkspace(world, 8, 128, 128, device="cuda") for _ in range(world)]
    results = {}
    for exchange in ("allgather", "ring"):
        o, g = simulate(ins, plan, exchange)
        assert rel_err(o, o_ref) < tol
        for n in GRADS:
            assert rel_err(g[n], getattr(g_ref, n)) < tol, n
        results[exchange] = (o, g)
    again = simulate(ins, plan, "allgather", workspaces=ws)
    # bitwise: repeat (with workspaces), and ring == allgather
    for other in (again, results["ring"]):
        assert torch.equal(results["allgather"][0], other[0])
        for n in GRADS:
            assert torch.equal(results["allgather"][1][n], other[1][n]), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_world_one_is_bitwise_single_gpu(dtype):
    offsets = [0, 1000, 1001, 3000]
    ins = make(offsets, dtype=dtype)
    o_ref, g_ref = single(ins, offsets)
    ctx = kcp.build_context_det_kcp(kcp.partition_det_kcp(offsets, 1), 0, device="cuda")
    leaves = [t.clone().requires_grad_(True) for t in ins[:5]]
    o = kcp.chunk_gated_delta_rule_det_kcp(*leaves, context=ctx, use_qk_l2norm_in_kernel=True)
    o.backward(ins[5])
    assert torch.equal(o, o_ref)
    for leaf, n in zip(leaves, GRADS):
        assert torch.equal(leaf.grad, getattr(g_ref, n)), n


def test_tf32_settings_do_not_change_bits():
    offsets, world = [0, 3000], 4
    ins = make(offsets, dtype=torch.float32)
    plan = kcp.partition_det_kcp(offsets, world, boundary="even")
    _same_bits_with_and_without_tf32(ins, plan, "allgather")


def test_conv_halo_on_gpu():
    offsets, world = [0, 2, 5, 1000, 1003], 4
    plan = kcp.partition_det_kcp(offsets, world, boundary="even")
    ctxs = kcp.build_simulated_contexts_det_kcp(plan, device="cuda", conv_kernel_size=4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1003, 256, generator=gen).cuda()
    w = (torch.randn(256, 4, generator=gen) * 0.5).cuda().requires_grad_(True)
    b = torch.randn(256, generator=gen).cuda().requires_grad_(True)
    dy = torch.randn(1, 1003, 256, generator=gen).cuda()
    xs = [x[:, slice(*plan.token_range(r))].clone().requires_grad_(True) for r in range(world)]
    ys = kcp.causal_conv1d_det_kcp_simulated(xs, w, b, ctxs)
    torch.autograd.backward(ys, [dy[:, slice(*plan.token_range(r))] for r in range(world)])
    xr = x.clone().requires_grad_(True)
    wr, br = (t.detach().clone().requires_grad_(True) for t in (w, b))
    yr = causal_conv1d(xr, wr, br, "silu", offsets, deterministic=True)
    yr.backward(dy)
    torch.testing.assert_close(torch.cat([y.detach() for y in ys], 1), yr.detach())
    torch.testing.assert_close(torch.cat([t.grad for t in xs], 1), xr.grad)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(b.grad, br.grad, rtol=1e-5, atol=1e-4)


# ------------------------------------------- segment plans: same bits, any world --

SEGMENT_LAYOUTS = [
    # (offsets, segment_size, world sizes)
    ([0, 8192], 1024, (1, 2, 3, 4, 8)),                       # one long document
    ([0, 300, 4396, 4397, 7000, 8192], 1024, (2, 3, 5, 8)),   # assorted, a one-token one
    ([0, 40, 4096], 512, (4, 7)),                             # 512-token segments
]


def single_segments(ins, offsets, S, l2=True):
    """The single-GPU deterministic call (what gdn_det_train runs) with segment size S."""
    from gdn_core.autograd import chunk_gdn_autograd

    leaves = [t.clone().requires_grad_(True) for t in ins[:5]]
    o, _ = chunk_gdn_autograd(*leaves, cu_seqlens=offsets, use_qk_l2norm_in_kernel=l2,
                              deterministic=True, segment_size=S)
    o.backward(ins[5])
    return o.detach(), {n: leaf.grad for n, leaf in zip(GRADS, leaves)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offsets,S,worlds", SEGMENT_LAYOUTS)
def test_segment_worlds_are_bitwise_the_single_gpu(offsets, S, worlds, dtype):
    ins = make(offsets, dtype=dtype)
    o_ref, g_ref = single_segments(ins, offsets, S)
    for world in worlds:
        plan = kcp.partition_det_kcp(offsets, world, boundary="segment", segment_size=S)
        for exchange in ("allgather", "ring"):
            o, g = simulate(ins, plan, exchange)
            what = f"world {world} {exchange} cuts {plan.cuts}"
            assert torch.equal(o, o_ref), what
            for n in GRADS:
                assert torch.equal(g[n], g_ref[n]), f"{what}: {n}"


def test_segment_worlds_accuracy_and_tf32_independence():
    offsets, S, world = [0, 6000, 8192], 1024, 4
    ins = make(offsets, dtype=torch.float32)
    plan = kcp.partition_det_kcp(offsets, world, boundary="segment", segment_size=S)
    a = _same_bits_with_and_without_tf32(ins, plan, "ring")
    o_plain, g_plain = single(ins, offsets)  # default segments: 1024 as well
    assert torch.equal(a[0], o_plain)
    low = make(offsets, dtype=torch.bfloat16)
    o16, g16 = simulate(low, plan, "allgather")
    assert rel_err(o16, a[0]) < 1e-2
    for n in GRADS:
        assert rel_err(g16[n], a[1][n]) < 1e-2, n
        assert torch.equal(a[1][n], getattr(g_plain, n)), n


@pytest.mark.skipif(not __import__("gdn_core.ops.gluon", fromlist=["available"]).available(),
                    reason="needs an sm_90 GPU with Gluon")
def test_segment_worlds_keep_their_bits_with_the_gluon_kernels(monkeypatch):
    """``GDN_CORE_GLUON=all``, bf16, K = V = 128, ``boundary="segment"``: worlds 1 to 4 give
    the same bits (partition invariance holds with every Gluon stage switched in), the
    Gluon kernels ran, and the results stay within bf16 tolerance of the Triton path's."""
    from gdn_core.ops import gluon
    from gdn_core.ops.registry import record_launches

    offsets = [0, 5, 700, 701, 1500]  # 695 and 799 tokens cross 128-token segments
    ins = make(offsets, dtype=torch.bfloat16)

    def world(size):
        plan = kcp.partition_det_kcp(offsets, size, boundary="segment", segment_size=128)
        with record_launches() as launches:
            out = simulate(ins, plan, "ring" if size % 2 else "allgather")
        return out, {launch.name.rsplit(".", 1)[-1] for launch in launches}

    monkeypatch.setenv(gluon.GLUON_ENV, "none")  # Triton everywhere
    monkeypatch.setenv("GDN_CORE_FUSED_FWD", "0")  # the fused forward replaces state+output
    (o_tri, g_tri), _ = world(1)
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    (o1, g1), names = world(1)
    assert {"wy_fwd_gluon", "wy_apply_gluon", "chunk_state_fwd_gluon", "chunk_output_fwd_gluon",
            "dv_local_bwd_gluon", "chunk_state_bwd_gluon",
            "chunk_grads_bwd_gluon_pipelined"} <= names, names
    assert rel_err(o1, o_tri) < 1e-2
    for n in GRADS:
        assert rel_err(g1[n], g_tri[n]) < 1e-2, n
    for size in (2, 3, 4):
        (o, g), _ = world(size)
        assert torch.equal(o, o1), size
        for n in GRADS:
            assert torch.equal(g[n], g1[n]), (size, n)
