#!/usr/bin/env python3
"""Context-parallel benchmark of ``gdn_det_train_kcp`` (deterministic KCP).

Arms: ``local`` (``gdn_det_train.chunk_gdn_det_fwd``/``_bwd`` on each rank's
shard, no state passing: the floor), ``kcp`` (``chunk_gdn_det_fwd_kcp`` /
``_bwd_kcp``, all-gather exchange) and ``ring`` (point-to-point exchange)::

    python benchmarks/bench_gdn_det_train_kcp.py --base local,kcp,ring \\
        --boundary chunk --seqlen 65536 --docs 16 --world 4 --simulate --json out.json

Real ranks are processes over torch.distributed (gloo on the CPU, NCCL with one
GPU per rank); ``--simulate`` runs every rank in this process. The shared
implementation is ``kcp_bench.py``; see ``benchmarks/README.md``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kcp_bench  # noqa: E402

if __name__ == "__main__":
    sys.exit(kcp_bench.main("det", str(Path(__file__).resolve())))
