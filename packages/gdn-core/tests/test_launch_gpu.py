"""The launch cache on the GPU (gdn_core.ops.launch): a cached launch computes what
Triton's launch computes, on the current stream, inside a CUDA graph too; a new
specialisation (a misaligned view, an int Triton specialises) compiles its own kernel;
a launch hook sends the call through Triton."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from gdn_core.ops import launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@triton.jit
def _axpy_kernel(x, y, out, n, a, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, a * tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)


def _fresh() -> launch.CachedLauncher:
    cached = launch.cached_launch(_axpy_kernel)
    if not cached._fast:
        pytest.skip("the launch cache is off here (GDN_CORE_FAST_LAUNCH=0 or another Triton)")
    return cached


def _call(cached, x, y, a=2.0):
    out = torch.empty_like(x)
    n = x.numel()
    cached[(triton.cdiv(n, 128),)](x, y, out, n, a, BLOCK=128)
    return out


def test_a_cached_launch_computes_what_tritons_launch_computes():
    cached = _fresh()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(1000, device="cuda", generator=gen) for _ in range(2))
    first = _call(cached, x, y)  # through Triton: compiles, remembers
    assert len(cached._cache) == 1
    x2, y2 = x.flip(0).contiguous(), y.flip(0).contiguous()
    second = _call(cached, x2, y2, a=-0.5)  # cached: same key, other tensors and float
    assert len(cached._cache) == 1
    torch.testing.assert_close(first, 2.0 * x + y, rtol=0, atol=1e-6)
    torch.testing.assert_close(second, -0.5 * x2 + y2, rtol=0, atol=1e-6)
    assert torch.equal(second, _call(launch.CachedLauncher(_axpy_kernel), x2, y2, a=-0.5))


def test_a_new_specialisation_compiles_its_own_kernel():
    cached = _fresh()
    buf = torch.randn(2048, device="cuda")
    _call(cached, buf[:1024], buf[1024:])
    misaligned = _call(cached, buf[1:1001], buf[1001:2001])  # 4-byte offset: not 16-aligned
    assert len(cached._cache) == 2
    torch.testing.assert_close(misaligned, 2.0 * buf[1:1001] + buf[1001:2001], rtol=0, atol=1e-6)
    one = _call(cached, buf[:1], buf[1:2])  # n == 1
    assert len(cached._cache) == 3
    torch.testing.assert_close(one, 2.0 * buf[:1] + buf[1:2], rtol=0, atol=1e-6)


def test_cached_launches_run_on_the_current_stream_and_in_a_graph():
    cached = _fresh()
    x = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    _call(cached, x, y)  # compile and remember on the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = _call(cached, x, y, a=3.0)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, 3.0 * x + y, rtol=0, atol=1e-6)

    static_out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cached[(triton.cdiv(4096, 128),)](x, y, static_out, 4096, 0.25, BLOCK=128)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, 0.25 * x + y, rtol=0, atol=1e-6)


def test_a_launch_hook_sends_the_call_through_triton():
    from triton import knobs

    cached = _fresh()
    x = torch.randn(256, device="cuda")
    _call(cached, x, x)
    seen = []

    def hook(metadata):
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = _call(cached, x, x)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1
    torch.testing.assert_close(out, 3.0 * x, rtol=0, atol=1e-6)


def test_a_cpu_tensor_after_cached_cuda_launches_gets_tritons_error():
    """The cached launch passes addresses; a CPU tensor keys apart, so Triton's own
    launcher checks it and raises instead of handing the kernel a host pointer."""
    cached = _fresh()
    x = torch.randn(256, device="cuda")
    _call(cached, x, x)
    _call(cached, x, x)
    with pytest.raises(ValueError, match="cpu tensor"):
        _call(cached, x.cpu(), x.cpu())


def test_a_cached_descriptor_launch_computes_what_tritons_launch_computes():
    """A Gluon launch with TMA descriptors takes the cached path with each descriptor's
    encoded map remembered per address and geometry: on new inputs, on inputs at the
    address of freed ones, and against the same launch through Triton's own path (cache
    emptied), the bits agree."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.gluon import available
    from gdn_core.testkit import offsets_of, state_fwd_inputs

    if not available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    from gdn_core.ops.gluon import fused_fwd

    lengths = [64, 200, 1]
    index = ChunkIndex.build(offsets_of(lengths), "cuda")

    def run(seed):
        p = state_fwd_inputs(lengths, 2, 2, 128, 128, torch.bfloat16, seed=seed)
        args = [p[x].cuda() for x in ("q", "k", "W", "U", "G")]
        return fused_fwd.chunk_fwd_fused_gluon(*args, 0.125, index, 1)[0]

    kernel = fused_fwd._FUSED_FWD_GLUON_KERNEL
    if not kernel._fast:
        pytest.skip("the launch cache is off here")
    first = run(0)
    cached = [run(1), run(2)]  # the second at the addresses the first freed, likely
    entry = next(iter(kernel._cache.values()))
    assert entry.c_launch is not None and entry.desc_meta  # the direct path served them
    kernel._cache.clear()
    launch._EXPANDED.clear()
    assert torch.equal(run(1), cached[0]) and torch.equal(run(2), cached[1])
    assert not torch.equal(first, cached[0])  # other inputs, other bits: the test can fail
