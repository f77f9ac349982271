"""Host (Python) cost of one deterministic forward+backward, measured on CPU.

The kernels are stubbed out (Triton interpreter launches return at once), so
what is timed is the library's own host work — validation, layout tables,
allocations, launch wrappers — which on a GPU decides whether small shapes are
launch-bound. Also counted per fwd+bwd: ``torch.tensor`` built from Python
lists (each one a pageable host→device copy on a GPU) and aten ops. The fold
is routed to its Triton launcher, as on CUDA. The outputs are garbage.

    TRITON_INTERPRET=1 python benchmarks/host_overhead_cpu.py [--iters 200] [--api autograd] [--ops]

``--api split`` (default) times ``chunk_gdn_det_fwd`` + ``chunk_gdn_det_bwd``;
``--api autograd`` times ``chunk_gated_delta_rule_det`` and ``backward()`` (the
custom op and autograd's own host work included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def _inputs(B, T, docs, H=1, D=16):
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, generator=gen) for _ in range(4))
    g = -torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    cu = torch.linspace(0, T, docs + 1).long().tolist() if docs > 1 else None
    return (q, k, v, g, beta), do, cu


def route_fold_to_triton() -> None:
    """Send the fp32 fold to its Triton launcher, as on CUDA (the CPU's default is its torch
    form, whose host cost is not the GPU's)."""
    import gdn_core.kcp.fold as fold

    real = fold.resolve_fold_impl
    fold.resolve_fold_impl = lambda d, t, impl=None: (
        "triton" if impl is None and t == torch.float32 else real(d, t, impl))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1x8192x1,4x8192x1,1x32768x1,1x32768x8",
                   help="BxTxDOCS, comma separated")
    p.add_argument("--segments", default="1024,0")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--api", choices=("split", "autograd"), default="split")
    p.add_argument("--ops", action="store_true", help="also list the aten ops of one call")
    args = p.parse_args()

    interp.InterpretedFunction.run = lambda self, *a, **k: None  # launches cost nothing
    import gdn_det_train as det

    route_fold_to_triton()

    for seg in (int(s) for s in args.segments.split(",")):
        for spec in args.shapes.split(","):
            B, T, docs = (int(x) for x in spec.split("x"))
            ins, do, cu = _inputs(B, T, docs)

            def step(ins=ins, do=do, cu=cu, seg=seg):
                _, _, saved = det.chunk_gdn_det_fwd(*ins, cu_seqlens=cu, segment_size=seg)
                return det.chunk_gdn_det_bwd(saved, do)

            if args.api == "autograd":
                leaves = [x.detach().requires_grad_() for x in ins]

                def step(leaves=leaves, do=do, cu=cu, seg=seg):  # noqa: F811 - the chosen API
                    for x in leaves:
                        x.grad = None  # no accumulation: each step writes fresh gradients
                    o, _ = det.chunk_gated_delta_rule_det(*leaves, cu_seqlens=cu,
                                                          segment_size=seg)
                    o.backward(do)

            for _ in range(5):
                step()
            ts = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
            with _Count() as c:
                step()
            print(f"{args.api} segment_size={seg:5d} B{B} T{T} docs{docs}: "
                  f"host min {min(ts) * 1e3:.3f} ms, "
                  f"median {statistics.median(ts) * 1e3:.3f} ms; torch.tensor(list) "
                  f"{c.ops.get('aten.lift_fresh.default', 0)}, aten ops {sum(c.ops.values())}",
                  flush=True)
            if args.ops:
                for op, n in sorted(c.ops.items(), key=lambda kv: -kv[1]):
                    print(f"    {n:3d} {op}")


if __name__ == "__main__":
    main()
