"""Host time of a simulated KCP world against the ``local`` arm, on the CPU, kernels not run.

    python benchmarks/kcp_host_cpu.py --world 8 --seqlen 65536 --docs 16 --heads 16 --dim 16

(``kcp_bench.py``'s options; a small ``--dim`` keeps the CPU's allocations cheap: the host
work depends on the plan, not on the head size.)

The inputs, plan and callables are ``kcp_bench.py``'s (``--boundary segment``,
deterministic package, the all-gather exchange). Every Triton launch returns at once
(``TRITON_INTERPRET=1``, the interpreter's run stubbed), so what is timed is the host work
of one forward+backward: of every rank's ``local`` call in turn, and of the simulated
world's (which also pays the in-memory exchange). On a single GPU a simulated world that
is host-bound shows its host ratio in ``kcp / local`` (issue 19's target 4): this says how
much of that ratio the library's own Python can explain. The fold is routed to its Triton
launcher, as on CUDA; every output is garbage.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import kcp_bench  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from host_overhead_cpu import route_fold_to_triton  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    spec = kcp_bench.PACKAGES["det"]
    args = kcp_bench.parse_args(spec, ["--simulate", "--boundary", "segment", "--device", "cpu",
                                       *argv])
    torch.set_num_threads(1)
    interpreter.InterpretedFunction.run = lambda self, *a, **k: None  # launches cost nothing
    route_fold_to_triton()
    dev = torch.device("cpu")
    api = kcp_bench.load_api(spec, ["local", "kcp"], True)
    prob = kcp_bench.make_problem(api, args, dev)
    W = args.world
    locals_ = [kcp_bench._local_callables(api, prob, r, args, dev)[1] for r in range(W)]
    ctxs = api.kcp_attr("build_simulated")(prob.plan, device=dev)
    _, kcp = kcp_bench._simulated_callables(api, prob, ctxs, "kcp", args, dev)

    local = [common.time_fn(step, device=dev, warmup=1, iters=args.iters,
                            flush_l2=False).median for step in locals_]
    clock = kcp_bench._SegmentClock(dev, W)
    per_rank: list[list[float]] = [[] for _ in range(W)]
    with kcp_bench._timed_simulation(clock):
        kcp()
        clock.collect()
        for _ in range(args.iters):
            kcp()
            for r, ms in enumerate(clock.collect()):
                per_rank[r].append(ms)
    ranks = [statistics.median(t) for t in per_rank]
    print(f"world {W}, T{args.seqlen} H{args.heads} {args.docs} docs, host ms of one "
          f"forward+backward a rank, launches stubbed (kcp: its stretches between exchanges, "
          f"as kcp_bench.py charges them)")
    shards = kcp_bench.plan_summary(prob.plan, W)
    for r in range(W):
        ratio = f"{ranks[r] / local[r]:.2f}" if shards[r]["tokens"] else "- (an empty shard)"
        print(f"  rank {r}: local {local[r]:.3f}, kcp {ranks[r]:.3f}, kcp / local {ratio}")
    print(f"slowest rank: local {max(local):.3f}, kcp {max(ranks):.3f}, "
          f"kcp / local {max(ranks) / max(local):.2f}")


if __name__ == "__main__":
    main()
