"""What makes a backward slower on autograd's device thread than on the caller (issue 18).

On CUDA, autograd runs a backward in its own device thread; with
``torch.autograd.set_multithreading_enabled(False)`` it runs on the calling thread. A det
forward+backward at B1 T1024 costs ~1 ms more host time the first way (session 28:
1.567 against 0.599 ms a call), yet an ``autograd.Function`` whose backward does nothing
pays the hand-off in ~0.15 ms. This probe times back-to-back forward+backward steps of
``autograd.Function``s whose backward does one kind of host work, both ways, so that the
kind the device thread makes expensive shows:

* ``nothing``: the floor (the hand-off, the node, the gradient accumulations);
* ``python``: pure Python work (``--python-us`` µs of it on the caller);
* ``empty``: ``--n`` ``torch.empty`` on the GPU;
* ``launch``: ``--n`` launches of an empty Triton kernel through the library's launch cache;
* ``det``: the real ``gdn_det_train`` call at ``--shape``.

With ``--pin CPU`` the process (the caller and autograd's device thread, made later,
inherit it) runs on that one CPU: if the device thread's extra time is the work moving
between cores (cold caches), it shrinks there.

    python benchmarks/device_thread_probe.py [--n 8] [--iters 200] [--repeats 5] [--pin CPU]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import triton
from gdn_core.ops.launch import cached_launch
from host_profile_gpu import _host_ms


@triton.jit
def _empty_kernel(x_ptr):
    pass


_EMPTY = cached_launch(_empty_kernel)


def _python_work(loops: int) -> int:
    acc = 0
    for i in range(loops):
        acc += len({"a": i, "b": i + 1})
    return acc


def _function(kind: str, n: int, loops: int, scratch: torch.Tensor):
    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            return xs[0] * 1

        @staticmethod
        def backward(ctx, do):
            if kind == "python":
                _python_work(loops)
            elif kind == "empty":
                for _ in range(n):
                    torch.empty(1024, device=scratch.device)
            elif kind == "launch":
                for _ in range(n):
                    _EMPTY[(1,)](scratch)
            return (do,) + (None,) * 4

    return Probe.apply


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=8, help="torch.empty calls / launches a backward")
    p.add_argument("--python-us", type=float, default=300.0)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shape", default="1,1024,16,128,128", help="B,T,H,K,V of the det step")
    p.add_argument("--pin", type=int, default=None, metavar="CPU",
                   help="run every thread of the process on this one CPU")
    args = p.parse_args()
    if args.pin is not None:  # before any CUDA work: autograd's device thread inherits it
        os.sched_setaffinity(0, {args.pin})

    dev = torch.device("cuda")
    scratch = torch.empty(16, device=dev)
    # calibrate the Python work on the caller
    t0 = time.perf_counter()
    _python_work(100_000)
    loops = int(100_000 * args.python_us * 1e-6 / (time.perf_counter() - t0))

    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(B, T, H, D, generator=gen).to(dev, torch.bfloat16).requires_grad_()
              for D in (K, K, V)]
    leaves += [(-torch.rand(B, T, H, generator=gen) / 16).to(dev).requires_grad_(),
               torch.rand(B, T, H, generator=gen).to(dev, torch.bfloat16).requires_grad_()]
    do = torch.randn(B, T, H, V, generator=gen).to(dev, torch.bfloat16)
    do_probe = torch.randn(B, T, H, K, generator=gen).to(dev, torch.bfloat16)  # of q's shape

    import gdn_det_train

    steps = {}
    for kind in ("nothing", "python", "empty", "launch"):
        fn = _function(kind, args.n, loops, scratch)

        def step(fn=fn):
            fn(*leaves).backward(do_probe)

        steps[kind] = step

    def det_step():
        o, _ = gdn_det_train.chunk_gated_delta_rule_det(*leaves)
        o.backward(do)

    steps["det"] = det_step
    for step in steps.values():  # warm: compile, the allocator's pools, the device thread
        for on_caller in (False, True):
            with torch.autograd.set_multithreading_enabled(not on_caller):
                for _ in range(5):
                    step()
    torch.cuda.synchronize()
    pinned = "" if args.pin is None else f"every thread on CPU {args.pin}; "
    print(f"backward work: n={args.n}, python {args.python_us:.0f} us on the caller; {pinned}"
          f"median of {args.repeats} rounds of {args.iters} steps, host ms a step")
    print(f"{'kind':10s} {'device thread':>14s} {'caller':>8s} {'difference':>11s}")
    for kind, step in steps.items():
        got = {True: [], False: []}
        for _ in range(args.repeats):
            for on_caller in (False, True):
                with torch.autograd.set_multithreading_enabled(not on_caller):
                    got[on_caller].append(_host_ms(step, args.iters))
        thread, caller = statistics.median(got[False]), statistics.median(got[True])
        print(f"{kind:10s} {thread:14.3f} {caller:8.3f} {thread - caller:11.3f}", flush=True)


if __name__ == "__main__":
    main()
