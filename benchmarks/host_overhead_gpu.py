"""Host time of back-to-back forward+backward calls on a GPU (issue 18's host target).

For each implementation — ``gdn_det_train``, ``gdn_train`` and, when importable,
fla's ``chunk_gated_delta_rule`` — the host loop of ``--iters`` autograd
forward+backward calls is timed without synchronising (the time the Python
thread spends enqueueing), then the queue is drained and the device time per
call taken. Also reported:

* whether a call synchronises (``torch.cuda.set_sync_debug_mode("warn")``
  around one call: the warnings reporting a synchronisation are counted, not
  the mode's own one-time "prototype feature" notice, :func:`sync_detections`);
* this library's kernel launches per call (the launcher registry) and the host
  cost of one Triton launch (an empty kernel, launched back to back), i.e. the
  floor the launches alone set. On CUDA the count is the forward's only: autograd
  runs a CUDA backward in its device thread, which the thread-local record
  (``record_launches``) does not see;
* the cached launches that went through Triton's argument binding in one call
  (:func:`gdn_core.ops.launch.slow_launches`; none expected: each is tens of µs of host
  time, the launch cache's docstring);
* with ``--backward-on-caller``, every arm's backward runs on the calling thread
  (``torch.autograd.set_multithreading_enabled(False)``): autograd otherwise hands a CUDA
  backward to its device thread, which cost 0.68 of 1.81 ms a step here (session 26,
  ``host_profile_gpu.py``) and is torch's, paid by every library;
* the CUDA-graph path: the same call captured once (a
  :class:`~gdn_core.layout.VarlenLayout`, fixed-size tables) and replayed: host
  time per replay.

On a machine without a GPU, ``--device cpu`` runs the same loop (reference
backend, or the interpreter with ``TRITON_INTERPRET=1``) as a check of the
script; its figures mean nothing for the GPU.

    python benchmarks/host_overhead_gpu.py [--shape 1,1024,16,128,128] [--dtype bfloat16]
        [--iters 200] [--no-fla] [--order gdn_train,gdn_det_train] [--pin CPU]
        [--backward-on-caller] [--json out.json]

fla dispatches to FlashQLA when ``flash_qla`` is importable: the ``fla`` arm sets
``FLA_FLASH_QLA=0`` before importing fla, so it times fla's own Triton kernels (the
issue's anchor) whatever is installed; ``--fla-dispatch`` leaves fla's dispatch on instead
(FlashQLA when present; it needs ``g`` in fp32, so that arm gets an fp32 ``g``) and the
output says which path ran. With Triton 3.6 on Hopper set
``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` (``--fla-force``) to let it run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch


def _inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen)) / 16
    beta = torch.rand(B, T, H, generator=gen).sigmoid()
    do = torch.randn(B, T, H, V, generator=gen)
    ins = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v, g, beta)]
    return ins, do.to(device=device, dtype=dtype)


def _implementations(args) -> dict[str, Callable]:
    import gdn_det_train
    import gdn_train

    impls = {"gdn_det_train": gdn_det_train.chunk_gated_delta_rule_det,
             "gdn_train": gdn_train.chunk_gated_delta_rule}
    if not args.no_fla:
        if not args.fla_dispatch:
            os.environ["FLA_FLASH_QLA"] = "0"
        try:
            import fla.ops.common.chunk_o as chunk_o
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
        except ImportError:
            print("fla not importable: not timed")
        else:
            if args.fla_force:
                chunk_o.TRITON_ABOVE_3_7_1 = True
            impls["fla"] = fla_gdn
    order = [n for n in args.order.split(",") if n in impls]
    return {n: impls[n] for n in order + [n for n in impls if n not in order]}


def _host_loop(step: Callable[[], None], iters: int, sync: Callable[[], None]
               ) -> tuple[float, float]:
    """``(host ms per call, wall ms per call once drained)`` of ``iters`` calls."""
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3 / iters, (t2 - t0) * 1e3 / iters


#: PyTorch's own notice, a ``TORCH_WARN_ONCE`` of the first ``set_sync_debug_mode`` call
#: in a process (``torch/csrc/cuda/Module.cpp``): it says "Synchronization" but reports
#: no synchronisation. Counted as one, it made the first implementation timed (then
#: ``gdn_det_train``) show one sync per call and the next ones none (session 7).
SYNC_MODE_NOTICE = "synchronization debug mode is a prototype feature"


def sync_detections(messages) -> list[str]:
    """The messages among ``messages`` (warning texts) that report a synchronising CUDA
    operation (``"called a synchronizing CUDA operation"``, or any other text naming a
    synchronisation), without the sync debug mode's own one-time notice."""
    out = []
    for m in map(str, messages):
        low = m.lower()
        if "synchroniz" in low and SYNC_MODE_NOTICE not in low:
            out.append(m)
    return out


def _sync_warnings(step: Callable[[], None], cuda: bool,
                   seen: list[str] | None = None) -> int | None:
    """Synchronisations of one ``step()`` seen by the sync debug mode (``None`` off CUDA);
    their messages are appended to ``seen``."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    found = sync_detections(w.message for w in caught)
    if seen is not None:
        seen.extend(found)
    return len(found)


def _triton_launch_us(device: str, n: int = 2000) -> dict | None:
    """Host µs per launch of an empty Triton kernel and of one with 24 arguments (12
    tensors, 12 ints: the width of this library's kernels), each through Triton's
    ``kernel[grid]`` and through the launch cache (:mod:`gdn_core.ops.launch`)."""
    if device != "cuda":
        return None
    import triton
    import triton.language as tl
    from gdn_core.ops.launch import CachedLauncher

    @triton.jit
    def _empty(x):
        tl.program_id(0)

    @triton.jit
    def _wide(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
              n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, B: tl.constexpr):
        tl.program_id(0)

    x = torch.empty(64, device=device)
    wide_args = [x] * 12 + [7, 16, 3, 128, 5, 6, 7, 8, 9, 10, 11, 12]

    def timed(launch) -> float:
        for _ in range(10):
            launch()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            launch()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) * 1e6 / n

    cached_empty, cached_wide = CachedLauncher(_empty), CachedLauncher(_wide)
    return {
        "empty_triton": timed(lambda: _empty[(1,)](x)),
        "empty_cached": timed(lambda: cached_empty[(1,)](x)),
        "wide_triton": timed(lambda: _wide[(1,)](*wide_args, B=64)),
        "wide_cached": timed(lambda: cached_wide[(1,)](*wide_args, B=64)),
    }


def _graph_replay_ms(fn: Callable, ins, do, iters: int) -> float:
    """Host ms per replay of one captured forward+backward (a fixed-size layout)."""
    from gdn_core.layout import VarlenLayout

    T = ins[0].shape[1] * ins[0].shape[0]
    flat = [x.detach().reshape(1, T, *x.shape[2:]).clone().requires_grad_() for x in ins]
    dflat = do.reshape(1, T, *do.shape[2:])
    layout = VarlenLayout([0, T], device="cuda", max_docs=4)

    def run():
        o, _ = fn(*flat, cu_seqlens=layout)
        o.backward(dflat)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    for x in flat:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    host, _ = _host_loop(graph.replay, iters, torch.cuda.synchronize)
    return host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1,1024,16,128,128", help="B,T,H,K,V")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5, help="host loops per implementation")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--fla-force", action="store_true")
    p.add_argument("--fla-dispatch", action="store_true",
                   help="let fla dispatch to FlashQLA (default: FLA_FLASH_QLA=0, fla's kernels)")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--order", default="gdn_det_train,gdn_train,fla",
                   help="the order the implementations are timed in (the rest after)")
    p.add_argument("--pin", type=int, default=None, metavar="CPU",
                   help="pin the process (every thread, every arm) to one CPU: autograd's "
                        "device thread then runs on the caller's core (docs/performance.md)")
    p.add_argument("--backward-on-caller", action="store_true",
                   help="every arm's backward on the calling thread "
                        "(torch.autograd.set_multithreading_enabled(False)): autograd's "
                        "device-thread hand-off out of both sides of the ratio")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
        print(f"pinned to CPU {args.pin} (all arms)")
    if args.backward_on_caller:
        print("every arm's backward on the calling thread (autograd multithreading off)")

    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ins, do = _inputs(B, T, H, K, V, dtype, args.device)
    results: dict = {"shape": args.shape, "dtype": args.dtype, "device": args.device,
                     "iters": args.iters, "pinned_cpu": args.pin,
                     "backward_on_caller": args.backward_on_caller,
                     "triton_launch_us": _triton_launch_us(args.device)}
    from gdn_core.ops.launch import slow_launches
    from gdn_core.ops.registry import record_launches

    impls = _implementations(args)
    if "fla" in impls:
        results["fla_path"] = ("fla's dispatch (FlashQLA when importable)" if args.fla_dispatch
                               else "fla's Triton kernels (FLA_FLASH_QLA=0)")
        print(f"fla arm: {results['fla_path']}")
    g32 = ins[3].detach().float().requires_grad_()
    for name, fn in impls.items():
        args_of = list(ins)
        if name == "fla" and args.fla_dispatch:
            args_of[3] = g32

        def step(fn=fn, args_of=args_of):
            for x in args_of:
                x.grad = None
            o = fn(*args_of)[0]
            with torch.autograd.set_multithreading_enabled(not args.backward_on_caller):
                o.backward(do)

        for _ in range(args.warmup):
            step()
        runs = [_host_loop(step, args.iters, sync) for _ in range(args.repeats)]
        before = slow_launches()
        with record_launches() as launches:
            step()
        slow = {k: n - before.get(k, 0) for k, n in slow_launches().items()
                if n > before.get(k, 0)}
        seen: list[str] = []
        row = {
            "host_ms": statistics.median(r[0] for r in runs),
            "wall_ms": statistics.median(r[1] for r in runs),
            "sync_warnings": _sync_warnings(step, cuda, seen),
            "sync_messages": sorted(set(seen)),
            "launches": len(launches) if name.startswith("gdn") else None,
            # cached launches that went through Triton's binding in one call (should be none)
            "unkeyed_launches": slow,
        }
        if cuda and name.startswith("gdn") and not args.no_graph:
            row["graph_replay_host_ms"] = _graph_replay_ms(fn, ins, do, args.iters)
        results[name] = row
        print(f"{name:14s} host {row['host_ms']:.3f} ms/call, drained {row['wall_ms']:.3f} ms/call,"
              f" syncs {row['sync_warnings']}, launches {row['launches']}"
              + (f", graph replay host {row['graph_replay_host_ms']:.3f} ms"
                 if "graph_replay_host_ms" in row else ""), flush=True)
        for m in row["sync_messages"]:
            print(f"    sync: {m}")
        if slow:
            print(f"    launches through Triton's binding (no cache key): {slow}")
    if "fla" in results:
        for name in ("gdn_det_train", "gdn_train"):
            ratio = results[name]["host_ms"] / results["fla"]["host_ms"]
            print(f"{name} host / fla host: {ratio:.2f}")
    if results["triton_launch_us"] is not None:
        us = results["triton_launch_us"]
        print(f"Triton launch host us each: empty kernel {us['empty_triton']:.1f} (cached "
              f"{us['empty_cached']:.1f}), 24 arguments {us['wide_triton']:.1f} (cached "
              f"{us['wide_cached']:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
