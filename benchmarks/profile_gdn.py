"""Where the time of one deterministic forward+backward goes (GPU only).

For each shape and segment size: the host time to enqueue one fwd+bwd (no
synchronisation), the wall time with synchronisation (median of ``--iters``),
and a torch.profiler table of the kernels (CUDA time, calls). A host time
close to the wall time means the call is launch-bound, not GPU-bound.
``--package fla`` (or ``flashqla``) profiles that library's ``chunk_gated_delta_rule``
(forward + ``autograd.grad``, loaded as ``bench_gdn_train.py``'s arm of that name)
on the same inputs, so the two kernel tables can be read side by side.

    python benchmarks/profile_gdn.py --shapes 1x8192x16x1,4x8192x16x1 --segments 1024,0

``--ncu`` marks one warm step with ``cudaProfilerStart``/``Stop`` (and skips the timing and
the torch profiler), for Nsight Compute's ``--profile-from-start off``::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section Occupancy --section WarpStateStats python benchmarks/profile_gdn.py \
        --ncu --shapes 1x32768x16x8 --segments 4096

``--gaps`` runs ``--iters`` steps back to back, as the benchmark times them (no
synchronisation between steps), under the torch profiler, and reads the GPU timeline: wall
time a step, the kernels' busy time a step, and the longest idle stretches between two
kernels with the kernels on either side — whether a step is GPU-bound or waits on the host,
and where. ``--package det`` / ``nondet`` (``bench_gdn_train.py``'s arms: the public call
through ``autograd.grad``, as timed there) or ``fla`` / ``flashqla``::

    python benchmarks/profile_gdn.py --gaps --package det --shapes 4x8192x16x1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_inputs(B: int, T: int, H: int, docs: int, HV: int, D: int, device: str,
                benchmark_lengths: bool = False):
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(B, T, H, D, generator=gen).to(device, bf)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1).to(device, bf)
    v = torch.randn(B, T, HV, D, generator=gen).to(device, bf)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen)).to(device)
    beta = torch.rand(B, T, HV, generator=gen).to(device, bf)
    do = torch.randn(B, T, HV, D, generator=gen).to(device, bf)
    cu = None
    if docs > 1 and benchmark_lengths:  # bench_gdn_train's uneven documents
        import itertools
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import common

        cuts = [0, *itertools.accumulate(common.doc_lengths(T, docs))]
        cu = torch.tensor(cuts, device=device, dtype=torch.int32)
    elif docs > 1:
        cuts = torch.linspace(0, T, docs + 1).long()
        cu = cuts.to(device=device, dtype=torch.int32)
    return (q, k, v, g, beta), do, cu


def _package_step(package: str):
    pkg = __import__(package)
    det = package == "gdn_det_train"
    fwd = pkg.chunk_gdn_det_fwd if det else pkg.chunk_gdn_fwd
    bwd = pkg.chunk_gdn_det_bwd if det else pkg.chunk_gdn_bwd

    def make(ins, do, cu, seg):
        def step():
            _, _, saved = fwd(*ins, cu_seqlens=cu, segment_size=seg)
            return bwd(saved, do)
        return step
    return make


def _anchor_step(arm: str):
    """A step of ``bench_gdn_train.py``'s ``arm`` (``fla`` or ``flashqla``): forward + grad."""

    def make(ins, do, cu, seg):
        from bench_gdn_train import load_arm  # this directory: the benchmark's arms

        fn = load_arm(arm, torch.device("cuda")).fn
        return _autograd_step(fn, ins, do, cu)
    return make


def _autograd_step(fn, ins, do, cu):
    leaves = [x.detach().requires_grad_(True) for x in ins]

    def step():
        o, _ = fn(*leaves, cu_seqlens=cu)
        return torch.autograd.grad(o, leaves, do)
    return step


def gpu_timeline(step, iters: int, top: int) -> str:
    """``iters`` steps back to back under the torch profiler: wall and kernel-busy ms a step,
    and the ``top`` longest idle stretches between kernels (with their neighbours)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    kernels = sorted((e["ts"], e["dur"], e["name"]) for e in trace.get("traceEvents", [])
                     if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e)
    if not kernels:
        return "no kernel events in the trace"
    busy = sum(d for _, d, _ in kernels)
    span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    gaps = sorted(((b[0] - (a[0] + a[1]), a[2], b[2]) for a, b in zip(kernels, kernels[1:])),
                  reverse=True)
    idle = sum(g for g, _, _ in gaps if g > 0)
    lines = [f"timeline of {iters} steps: wall {start.elapsed_time(end) / iters:.3f} ms a step "
             f"(events), kernels span {span / 1e3 / iters:.3f}, busy {busy / 1e3 / iters:.3f}, "
             f"idle {idle / 1e3 / iters:.3f} ms a step ({len(kernels) // iters} kernels a step)"]
    for g, a, b in gaps[:top]:
        lines.append(f"  idle {g:8.1f} us  after {a[:60]}  before {b[:60]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1x8192x16x1,4x8192x16x1,1x32768x16x1",
                   help="BxTxHxDOCS[xHV], comma separated")
    p.add_argument("--segments", default="1024,0", help="segment sizes (0: plain path)")
    p.add_argument("--benchmark-lengths", action="store_true",
                   help="documents of bench_gdn_train's uneven lengths (default: equal)")
    p.add_argument("--package", default="gdn_det_train",
                   choices=["gdn_det_train", "gdn_train", "det", "nondet", "fla", "flashqla"],
                   help="a package's fwd/bwd functions, or an arm of bench_gdn_train.py")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rows", type=int, default=18)
    p.add_argument("--ncu", action="store_true",
                   help="one warm step between cudaProfilerStart/Stop, nothing timed")
    p.add_argument("--gaps", action="store_true",
                   help="the GPU timeline of --iters back-to-back steps: busy, idle, gaps")
    args = p.parse_args()
    anchor = args.package in ("det", "nondet", "fla", "flashqla")
    make_step = _anchor_step(args.package) if anchor else _package_step(args.package)
    segments = [0] if anchor else [int(s) for s in args.segments.split(",")]
    for spec in args.shapes.split(","):
        dims = [int(x) for x in spec.split("x")]
        B, T, H, docs = dims[:4]
        HV = dims[4] if len(dims) > 4 else H
        ins, do, cu = make_inputs(B, T, H, docs, HV, 128, "cuda", args.benchmark_lengths)
        for seg in segments:
            step = make_step(ins, do, cu, seg)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            if args.ncu:  # the one step Nsight Compute profiles (--profile-from-start off)
                torch.cuda.cudart().cudaProfilerStart()
                step()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"=== {args.package} B{B} T{T} H{H} HV{HV} docs{docs} segment_size={seg}:"
                      " one step profiled", flush=True)
                continue
            if args.gaps:
                print(f"=== {args.package} B{B} T{T} H{H} HV{HV} docs{docs} segment_size={seg}\n"
                      + gpu_timeline(step, args.iters, args.rows), flush=True)
                continue
            host, wall = [], []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                step()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                host.append((t1 - t0) * 1e3)
                wall.append((t2 - t0) * 1e3)
            print(f"\n=== {args.package} B{B} T{T} H{H} HV{HV} docs{docs} segment_size={seg}: "
                  f"host enqueue {statistics.median(host):.3f} ms, "
                  f"wall {statistics.median(wall):.3f} ms", flush=True)
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU,
                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                            max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
