"""Which kernels each rank of a simulated KCP world launches, against the ``local`` arm
(the same shard alone) — on the CPU, kernels not run.

    python benchmarks/kcp_launch_plan.py --world 4 --seqlen 65536 --docs 16 [--segment-size S]

The inputs and the plan are ``kcp_bench.py``'s (``--boundary segment``, deterministic
package). Under ``TRITON_INTERPRET=1`` every Triton launch is recorded instead of run
(name, grid, and for the state kernels the documents of the launch and the longest
serial walk in chunks), so a 64K-token world is planned in seconds; outputs are left
unwritten. Per rank it prints the ``local`` arm's forward+backward launches, then the
KCP arm's (allgather exchange), so extra work of context parallelism shows as extra
or wider launches. Timing differences with the same launches are not kernel work. The
segment fold runs its torch form on the CPU (on CUDA it is one more Triton launch per
fold, not listed here).
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kcp_bench  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

Launch = tuple[int | None, str, tuple[int, ...], str]
_LOG: list[Launch] = []
_RANK: list[int | None] = [None]


def _record(self, *args, grid, warmup, **kwargs):  # replaces InterpretedFunction.run
    bound = dict(zip(self.arg_names, args), **kwargs)
    shape = tuple(grid(bound) if callable(grid) else grid)
    what = ""
    if "doc_chunk_offsets" in bound:  # the state kernels: one program walks a document
        per_doc = bound["doc_chunk_offsets"].diff().tolist()
        what = f"docs {len(per_doc)}, longest walk {max(per_doc, default=0)} chunks"
    _LOG.append((_RANK[0], self.fn.__name__, shape, what))


class _RankNotes(kcp_bench._SegmentClock):
    """The benchmark's per-rank stretch wrapper, noting which rank each stretch (and so
    each launch) belongs to instead of timing it."""

    def _start(self, rank: int) -> None:
        _RANK[0] = rank

    def _stop(self, rank: int, start) -> None:
        pass


def _show(title: str, launches: list[Launch]) -> None:
    counts = collections.Counter((n, g, w) for _, n, g, w in launches)
    print(f"{title}: {len(launches)} launches")
    for (name, grid, what), n in sorted(counts.items()):
        print(f"  {n}x {name} grid={grid}" + (f" ({what})" if what else ""))


def main(argv: list[str] | None = None) -> None:
    spec = kcp_bench.PACKAGES["det"]
    argv = list(sys.argv[1:] if argv is None else argv)
    args = kcp_bench.parse_args(spec, ["--simulate", "--boundary", "segment", "--device", "cpu",
                                       *argv])
    args.base = ["local", "kcp"]
    dev = torch.device("cpu")
    interpreter.InterpretedFunction.run = _record
    api = kcp_bench.load_api(spec, args.base, True)
    prob = kcp_bench.make_problem(api, args, dev)
    W = args.world
    local = []
    for r in range(W):
        _LOG.clear()
        _RANK[0] = r
        kcp_bench._local_callables(api, prob, r, args, dev)[1]()
        local.append(list(_LOG))

    ctxs = api.kcp_attr("build_simulated")(prob.plan, device=dev)
    _, fwd_bwd = kcp_bench._simulated_callables(api, prob, ctxs, "kcp", args, dev)
    _LOG.clear()
    with kcp_bench._timed_simulation(_RankNotes(dev, W)):
        fwd_bwd()
    for row in kcp_bench.plan_summary(prob.plan, W):
        r = row["rank"]
        print(f"\n== rank {r}: {row['tokens']} tokens, {row['fragments']} fragments, from "
              f"{row['continues_from']}, into {row['continues_into']}")
        _show("local", local[r])
        mine = [x for x in _LOG if x[0] == r]
        same = sorted(x[1:] for x in mine) == sorted(x[1:] for x in local[r])
        _show("kcp" + (" (the same launches)" if same else ""), mine)


if __name__ == "__main__":
    main()
