"""The host cost of running a backward on another thread, on the CPU (issue 18).

The CPU counterpart of ``device_thread_probe.py``: the det split API's forward on the
caller, its backward either on the caller or on a worker thread fed through a queue (as
autograd's device thread is), with the kernels stubbed (Triton's interpreter launches
return at once), so only host work is timed. Also the bare round trip to the worker.
``--pin CPU`` puts both threads on one CPU: if the worker's extra time is the work moving
between cores, it shrinks there.

    python benchmarks/thread_hop_cpu.py [--shape 1,1024,16,128] [--iters 300] [--pin CPU]
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402
from host_overhead_cpu import _inputs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1,1024,16,128", help="B,T,H,D")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pin", type=int, default=None, metavar="CPU")
    args = p.parse_args()
    torch.set_num_threads(1)  # no intra-op pool competing for the CPUs
    if args.pin is not None:  # the worker, started below, inherits it
        os.sched_setaffinity(0, {args.pin})
    interp.InterpretedFunction.run = lambda self, *a, **k: None  # launches cost nothing
    import gdn_det_train as det

    B, T, H, D = (int(x) for x in args.shape.split(","))
    ins, do, _ = _inputs(B, T, 1, H=H, D=D)
    todo: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def worker() -> None:
        while True:
            saved = todo.get()
            done.put(None if saved is None else det.chunk_gdn_det_bwd(saved, do))

    threading.Thread(target=worker, daemon=True).start()

    def forward():
        return det.chunk_gdn_det_fwd(*ins)[2]

    steps = {
        "backward on the caller": lambda: det.chunk_gdn_det_bwd(forward(), do),
        "backward on the worker": lambda: (todo.put(forward()), done.get()),
        "round trip alone": lambda: (todo.put(None), done.get()),
    }
    pinned = "" if args.pin is None else f", both threads on CPU {args.pin}"
    print(f"B{B} T{T} H{H} D{D}, kernels stubbed{pinned}; ms a step, each round")
    for name, step in steps.items():
        for _ in range(10):
            step()
        got = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            got.append((time.perf_counter() - t0) / args.iters * 1e3)
        print(f"{name:24s} " + " ".join(f"{t:.3f}" for t in got), flush=True)


if __name__ == "__main__":
    main()
