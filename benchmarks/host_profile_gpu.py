"""Where the host time of one forward+backward goes (issue 18): cProfile of back-to-back calls.

``benchmarks/host_overhead_gpu.py`` gives the totals; this script splits them. On CUDA,
autograd runs the backward in its own device thread, which cProfile (per thread) does
not see, so three loops are profiled in the main thread:

* ``autograd-fwd``: the autograd call's forward only (no graph kept: ``torch.no_grad``
  is *not* used, the output is dropped);
* ``split``: the split API's forward then backward (``chunk_gdn_det_fwd`` /
  ``chunk_gdn_det_bwd``): the same kernels, no custom op, no autograd;
* host time per step, unprofiled, interleaved (``--repeats`` rounds, medians): the
  autograd forward+backward, its forward alone, the split forward+backward, and two
  floors — an ``autograd.Function`` with the same five leaves whose bodies launch nothing
  (autograd's own cost: node, saved tensors, engine, the device thread, five gradient
  accumulations) and ``--launches`` back-to-back launches of an empty Triton kernel with
  24 arguments (Triton's launch path with as many arguments as ours take).

    python benchmarks/host_profile_gpu.py [--shape 1,1024,16,128,128] [--iters 100]
        [--top 40] [--package gdn_det_train]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import os
import pstats
import statistics
import time

import torch
from host_overhead_gpu import _inputs


def _host_ms(step, iters: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / iters


class _Empty(torch.autograd.Function):
    """Autograd's floor: five leaves in, one output, bodies that launch nothing."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        ctx.save_for_backward(q, k, v, g, beta)
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, do):
        return tuple(torch.empty_like(x) for x in ctx.saved_tensors)


def _launch_floor(n: int):
    """``n`` launches of an empty kernel taking 24 arguments (12 pointers, 12 ints)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _empty24(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11,
                 i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, C: tl.constexpr):
        tl.program_id(0)

    ptrs = [torch.empty(64, device="cuda") for _ in range(12)]
    ints = [1024 + i for i in range(12)]

    def step():
        for _ in range(n):
            _empty24[(4, 16)](*ptrs, *ints, C=64)

    return step


def _profile(step, iters: int, top: int, title: str) -> None:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    print(f"=== {title}: {stats.total_calls / iters:.0f} Python calls per step, "
          f"{stats.total_tt * 1e3 / iters:.3f} ms profiled per step")
    stats.sort_stats("tottime").print_stats(top)
    print("\n".join(out.getvalue().splitlines()[6:]))
    out.seek(0)
    out.truncate()
    stats.sort_stats("cumulative").print_stats(top)
    print("\n".join(out.getvalue().splitlines()[6:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1,1024,16,128,128", help="B,T,H,K,V")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--package", default="gdn_det_train")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--launches", type=int, default=10, help="our launches per fwd+bwd")
    p.add_argument("--one-core", type=int, default=None, metavar="CPU",
                   help="pin this thread and the ones started after it (autograd's device "
                        "thread) to this CPU: is the device thread's cost cache migration?")
    args = p.parse_args()
    if args.one_core is not None:
        os.sched_setaffinity(0, {args.one_core})
        torch.set_num_threads(1)
        print(f"pinned to CPU {args.one_core}")
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    ins, do = _inputs(B, T, H, K, V, getattr(torch, args.dtype), "cuda")
    pkg = importlib.import_module(args.package)
    det = args.package.startswith("gdn_det")
    call = pkg.chunk_gated_delta_rule_det if det else pkg.chunk_gated_delta_rule
    fwd = pkg.chunk_gdn_det_fwd if det else pkg.chunk_gdn_fwd
    bwd = pkg.chunk_gdn_det_bwd if det else pkg.chunk_gdn_bwd
    plain = [x.detach() for x in ins]

    def autograd_fwd():
        call(*ins)

    def autograd_step():
        for x in ins:
            x.grad = None
        call(*ins)[0].backward(do)

    def split_step():
        _, _, saved = fwd(*plain)
        bwd(saved, do)

    def floor_step():
        for x in ins:
            x.grad = None
        _Empty.apply(*ins).backward(do)

    def autograd_step_one_thread():  # the backward on this thread, not autograd's device one
        with torch.autograd.set_multithreading_enabled(False):
            autograd_step()

    import concurrent.futures
    worker = concurrent.futures.ThreadPoolExecutor(1)

    def split_bwd_on_worker():  # the split backward on another Python thread
        _, _, saved = fwd(*plain)
        worker.submit(bwd, saved, do).result()

    arms = {"autograd fwd+bwd": autograd_step,
            "autograd fwd+bwd, one thread": autograd_step_one_thread,
            "split fwd, bwd on a worker": split_bwd_on_worker,
            "autograd fwd": autograd_fwd,
            "split fwd+bwd": split_step, "floor: autograd, no kernels": floor_step,
            f"floor: {args.launches} Triton launches": _launch_floor(args.launches)}
    for fn in arms.values():
        for _ in range(5):
            fn()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, fn in arms.items():
            times[name].append(_host_ms(fn, args.iters))
    for name, ts in times.items():
        print(f"{name:30s} host {statistics.median(ts):.3f} ms/step "
              f"(min {min(ts):.3f}, max {max(ts):.3f}, {args.repeats} rounds of {args.iters})")
    _profile(autograd_fwd, args.iters, args.top, "autograd-fwd")
    _profile(split_step, args.iters, args.top, "split fwd+bwd")


if __name__ == "__main__":
    main()
