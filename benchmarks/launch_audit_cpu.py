"""Every device-work launch of one deterministic forward+backward, counted on CPU.

Runs ``gdn_det_train.chunk_gated_delta_rule_det`` + ``backward()`` (the eager autograd
path a training step takes) under the Triton interpreter at tiny shapes with the
structure of the anchor calls, with q/k L2-normalised in the kernel, initial state
given or not, final state returned or not, and lists (``--verbose``) every Triton kernel
launch and every aten op with device work (fills, copies, casts, gathers) or an
allocation (:class:`gdn_core.testkit.LaunchAudit`). Views and the ops inside an
interpreted kernel are not counted.

The forward's last phase runs the fused kernel and the fold its Triton kernel, as on
CUDA at K = V = 128, 16-bit (``--cpu-path``: the CPU's own choices).

    python benchmarks/launch_audit_cpu.py [--verbose] [--cpu-path]
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"

CASES = {
    # name: (document lengths, segment size) — tiny, with the anchors' structure
    "1doc": ([256], 128),  # B1 T8192, default segments of 4096: one document, two segments
    "8docs": ([96, 200, 64, 130, 30, 250, 70, 100], 128),  # packed, some longer than S
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--cpu-path", action="store_true")
    args = p.parse_args()
    import gdn_det_train as det
    from gdn_core.testkit import audit_fwd_bwd

    for name, (lengths, S) in CASES.items():
        for h0 in (False, True):
            for final in (False, True):
                a = audit_fwd_bwd(det.chunk_gated_delta_rule_det, lengths, S, h0=h0,
                                  final=final, cuda_like=not args.cpu_path)
                c = a.counts()
                print(f"{name} h0={h0!s:5} final={final!s:5}: triton {c['triton']:2d}, "
                      f"aten work {c['work']:2d}, alloc {c['alloc']:2d}", flush=True)
                if args.verbose:
                    for line in a.listing():
                        print("    " + line)


if __name__ == "__main__":
    main()
