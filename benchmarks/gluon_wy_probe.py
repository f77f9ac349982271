"""Timing probe: the Gluon WY kernel against the pinned Triton one (GPU only).

Times :func:`gdn_core.ops.wy.wy_fwd` (Triton, the pinned configuration) and
:func:`gdn_core.ops.gluon.wy.wy_fwd_gluon` on the benchmark's bf16 inputs
(``common.make_gdn_inputs``) at B1 T32768 H16 K=V=128 with 1 and 8 documents, ``G``
from :func:`chunk_cumsum_fwd` (``common.time_fn``: CUDA-event medians of 20 after 3
warm-ups; ``--flush-l2`` flushes L2 between iterations). Prints ms per call (with
``A_inv`` and, for the Gluon kernel, also with ``output_A_inv=False``, which skips its
fp32 write), the ratio, the largest |difference| of ``A_inv``, ``W``, ``U`` between the
two, and whether two Gluon calls give the same bits; the Gluon kernel at 4 warps (the
launcher's) and 8 (``--warps``), at register caps ``--maxnreg``; both also as the det forward
calls them (``A_inv_for_backward=True``: the 16-bit inverse the backward reads). Needs
Triton 3.6's Gluon and an sm_90 GPU::

    python benchmarks/gluon_wy_probe.py [--tokens 32768] [--docs 1,8] [--warps 4,8]
        [--maxnreg none,128]
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

H, D = 16, 128


def _problem(T: int, docs: int) -> dict:
    """Inputs of the WY stage, as ``gluon_output_probe._problem`` builds the forward's."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    index = ChunkIndex.build(inp.offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    return dict(k=k, v=v, beta=beta, G=G, index=index, group=1)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--flush-l2", action="store_true")
    parser.add_argument("--warps", default="4,8",
                        help="Gluon kernel warps to time (4: the launcher's pinned one warpgroup; "
                             "8: two warpgroups)")
    parser.add_argument("--merge-k", default="32",
                        help="depths of the 32x32 merge's dot slices to time (32: whole dots, "
                             "163 registers; 16: 106 registers, four CTAs an SM)")
    parser.add_argument("--maxnreg", default="none",
                        help="register caps of the Gluon forward to time (none: ptxas's "
                             "choice; 128: four CTAs an SM)")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_wy_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import triton
    from gdn_core.ops.gluon import wy as gw
    from gdn_core.ops.wy import wy_fwd

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{H} K=V={D} bf16, flush_l2={args.flush_l2}")

    def time(fn) -> float:
        return common.time_fn(fn, device="cuda", warmup=3, iters=20,
                              flush_l2=args.flush_l2).median

    for docs in (int(x) for x in args.docs.split(",")):
        p = _problem(args.tokens, docs)
        call = (p["k"], p["v"], p["beta"], p["G"], p["index"], p["group"])
        ref = wy_fwd(*call)
        t_tr = time(lambda c=call: wy_fwd(*c))
        # the det forward's call: the backward's 16-bit inverse too
        t_tr16 = time(lambda c=call: wy_fwd(*c, A_inv_for_backward=True))
        print(f"D{docs}: triton {t_tr:.4f} ms, with the 16-bit inverse {t_tr16:.4f} "
              f"(max|A_inv| {ref[0].abs().max().item():.3e}, "
              f"max|W| {ref[1].float().abs().max().item():.3e})")
        pinned = gw.GLUON_WY_WARPS, gw.GLUON_WY_MAXNREG, gw.GLUON_WY_MERGE_K
        configs = [(w, c, m) for w in (int(x) for x in args.warps.split(","))
                   for c in args.maxnreg.split(",") for m in (int(x) for x in
                                                              args.merge_k.split(","))]
        try:
            for warps, cap, merge in configs:
                gw.GLUON_WY_WARPS = warps
                gw.GLUON_WY_MAXNREG = None if cap == "none" else int(cap)
                gw.GLUON_WY_MERGE_K = merge
                out = gw.wy_fwd_gluon(*call)
                again = gw.wy_fwd_gluon(*call)
                a16 = gw.wy_fwd_gluon(*call, A_inv_for_backward=True)
                same = (all(torch.equal(a, b) for a, b in zip(out, again))
                        and torch.equal(a16[0], out[0].to(a16[0].dtype))
                        and torch.equal(a16[1], out[1]) and torch.equal(a16[2], out[2]))
                diffs = " ".join(f"{n} {_maxdiff(a, b):.3e}"
                                 for n, a, b in zip(("A_inv", "W", "U"), out, ref))
                t_gl = time(lambda c=call: gw.wy_fwd_gluon(*c))
                t_na = time(lambda c=call: gw.wy_fwd_gluon(*c, output_A_inv=False))
                t_16 = time(lambda c=call: gw.wy_fwd_gluon(*c, A_inv_for_backward=True))
                print(f"D{docs}: gluon warps={warps} maxnreg={cap} merge_k={merge} "
                      f"{t_gl:.4f} ms (no A_inv "
                      f"{t_na:.4f}, 16-bit inverse {t_16:.4f}) | gluon/triton "
                      f"{t_gl / t_tr:.3f}, with the 16-bit inverse {t_16 / t_tr16:.3f} | "
                      f"max|diff| {diffs} | repeatable, 16-bit = fp32 rounded {same}")
        finally:
            gw.GLUON_WY_WARPS, gw.GLUON_WY_MAXNREG, gw.GLUON_WY_MERGE_K = pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
