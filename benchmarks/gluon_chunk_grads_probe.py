"""Timing probe: the Gluon chunk-gradient kernel against the Triton pair (GPU only).

Times :func:`gdn_core.ops.chunk_grads_bwd.chunk_grads_bwd` (``_dq_dv_kernel`` +
``_dk_kernel``, the pinned configuration) and
:func:`gdn_core.ops.gluon.chunk_grads.chunk_grads_bwd_gluon` (one kernel) on the inputs
``kernel_variants._problem`` builds (the benchmark's bf16 inputs, ``common.make_gdn_inputs``,
through the forward and the state backward) at B1 T32768 H16 K=V=128 with 1 and 8
documents, ``dq``/``dk`` rounded into bf16 as the backward runs it at one value head per
q/k head (``common.time_fn``: CUDA-event medians of 20 after 3 warm-ups; ``--flush-l2``
flushes L2 between iterations). Prints ms per call, the ratio, the largest relative
difference per output (max |gluon − triton| / max |triton|) and whether two Gluon calls
give the same bits. ``--warps`` also times the Gluon kernel at other warp counts (8 is
the launcher's; 4 compiles with spills). Needs Triton 3.6's Gluon and an sm_90 GPU::

    python benchmarks/gluon_chunk_grads_probe.py [--tokens 32768] [--docs 1,8] [--warps 8] \
        [--flush-l2]

On a machine without one it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

NAMES = ("dq", "dk", "dv", "dbeta", "dg")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--flush-l2", action="store_true")
    parser.add_argument("--warps", default="8",
                        help="Gluon kernel warps to time (8: the launcher's two warpgroups)")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_chunk_grads_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import kernel_variants
    import triton
    from gdn_core.ops.chunk_grads_bwd import chunk_grads_bwd
    from gdn_core.ops.gluon import chunk_grads as gc

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{kernel_variants.H} K=V={kernel_variants.D} bf16, flush_l2={args.flush_l2}")
    for docs in (int(x) for x in args.docs.split(",")):
        p = kernel_variants._problem(args.tokens, docs, "cuda")
        call = (p["q"], p["k"], p["v"], p["v_new"], p["h"], p["dh"], p["do"], p["dvp"], p["G"],
                p["beta"], p["A_inv"], p["scale"], p["index"], 1, p["g_dtype"])

        def run(fn, c=call):
            return fn(*c, dq=torch.empty_like(c[0]), dk=torch.empty_like(c[1]))

        tri = run(chunk_grads_bwd)
        t_tr = common.time_fn(lambda: run(chunk_grads_bwd), device="cuda", warmup=3, iters=20,
                              flush_l2=args.flush_l2).median
        print(f"D{docs}: triton pair {t_tr:.4f} ms")
        pinned = gc.GLUON_CHUNK_GRADS_WARPS
        try:
            for warps in (int(x) for x in args.warps.split(",")):
                gc.GLUON_CHUNK_GRADS_WARPS = warps
                got = run(gc.chunk_grads_bwd_gluon)
                same = all(torch.equal(a, b) for a, b in zip(got, run(gc.chunk_grads_bwd_gluon)))
                rel = " ".join(f"{n} {_rel(a, b):.2e}" for n, a, b in zip(NAMES, got, tri))
                t_gl = common.time_fn(lambda: run(gc.chunk_grads_bwd_gluon), device="cuda",
                                      warmup=3, iters=20, flush_l2=args.flush_l2).median
                print(f"D{docs}: gluon warps={warps} {t_gl:.4f} ms | gluon/triton "
                      f"{t_gl / t_tr:.3f} | max rel diff {rel} | repeatable {same}")
        finally:
            gc.GLUON_CHUNK_GRADS_WARPS = pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
