"""Timing probe: the Gluon dv_local kernel against the pinned Triton one (GPU only).

Times :func:`gdn_core.ops.dv_local.dv_local_bwd` (Triton, the pinned configuration,
and the 3-stage launch variant) and :func:`gdn_core.ops.gluon.dv_local.dv_local_bwd_gluon`
on the benchmark's bf16 inputs (``common.make_gdn_inputs``: ``q, k, g, do``) at B1
T32768 H16 K=V=128 with 1 and 8 documents (``common.time_fn``: CUDA-event medians of 20
after 3 warm-ups; ``--flush-l2`` flushes L2 between iterations). Prints ms per call, the
ratio to the pinned Triton kernel, the largest |difference| between the two results,
and whether two Gluon calls give the same bits; the Gluon kernel at 4 warps (the
launcher's) and 8 (``--warps``; two warpgroups splitting the value columns), with the
TMA store of full chunks (the launcher's) and with register stores only (``--stores``),
at 4 warps with the launcher's 128-register cap (four CTAs an SM) and uncapped
(``--maxnreg``; 0: no cap, 136 registers, three CTAs an SM).
Needs Triton 3.6's Gluon and an sm_90 GPU::

    python benchmarks/gluon_dv_local_probe.py [--tokens 32768] [--docs 1,8] [--warps 4,8]
        [--stores tma,regs] [--maxnreg 128,0] [--flush-l2]

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
    """Inputs of the dv_local stage, as ``kernel_variants._problem`` builds them."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta, do = (x[0].contiguous() for x in (*inp.leaves, inp.do))
    index = ChunkIndex.build(inp.offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    return dict(q=q, k=k, G=G, do=do, scale=D**-0.5, index=index, group=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--flush-l2", action="store_true")
    parser.add_argument("--warps", default="4,8",
                        help="Gluon kernel warps to time (4: the launcher's one warpgroup; "
                             "8: two warpgroups splitting the columns)")
    parser.add_argument("--stores", default="tma,regs",
                        help="Gluon stores to time (tma: full chunks by TMA, the launcher's; "
                             "regs: register stores only)")
    parser.add_argument("--maxnreg", default="128,0",
                        help="register caps of the 4-warp kernel to time (0: none)")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_dv_local_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import triton
    from gdn_core.ops import dv_local as tdv
    from gdn_core.ops.gluon import dv_local as gd

    def timed(fn) -> float:
        return common.time_fn(fn, device="cuda", warmup=3, iters=20,
                              flush_l2=args.flush_l2).median

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{H} K=V={D} bf16, flush_l2={args.flush_l2}")
    for docs in (int(x) for x in args.docs.split(",")):
        p = _problem(args.tokens, docs)
        call = (p["q"], p["k"], p["G"], p["do"], p["scale"], p["index"], p["group"])
        dv_tr = tdv.dv_local_bwd(*call)
        ref = dv_tr.float().abs().max().item()
        t_tr = timed(lambda c=call: tdv.dv_local_bwd(*c))
        print(f"D{docs}: triton {t_tr:.4f} ms (max|dv| {ref:.3e})")
        pinned_cfg = tdv.dv_local_config
        tdv.dv_local_config = lambda *a, _p=pinned_cfg, **kw: {**_p(*a, **kw), "num_stages": 1}
        try:
            t_tr1 = timed(lambda c=call: tdv.dv_local_bwd(*c))
            same = torch.equal(tdv.dv_local_bwd(*call), dv_tr)
        finally:
            tdv.dv_local_config = pinned_cfg
        stages = pinned_cfg(D, D)["num_stages"]
        print(f"D{docs}: triton num_stages=1 {t_tr1:.4f} ms (pinned {stages} / 1: "
              f"{t_tr / t_tr1:.3f}, bitwise equal {same})")
        pinned = gd.GLUON_DV_LOCAL_WARPS, gd.GLUON_DV_LOCAL_TMA_STORE, gd.GLUON_DV_LOCAL_MAXNREG
        runs = [(w, st, int(c) or None) for st in args.stores.split(",")
                for w in (int(x) for x in args.warps.split(","))
                for c in (args.maxnreg.split(",") if w == 4 else ["0"])]
        try:
            for warps, store, cap in runs:
                gd.GLUON_DV_LOCAL_WARPS, gd.GLUON_DV_LOCAL_TMA_STORE = warps, store == "tma"
                gd.GLUON_DV_LOCAL_MAXNREG = cap
                dv_gl = gd.dv_local_bwd_gluon(*call)
                same = torch.equal(dv_gl, gd.dv_local_bwd_gluon(*call))
                diff = (dv_gl.float() - dv_tr.float()).abs().max().item()
                t_gl = timed(lambda c=call: gd.dv_local_bwd_gluon(*c))
                print(f"D{docs}: gluon warps={warps} stores={store} maxnreg={cap} "
                      f"{t_gl:.4f} ms | gluon/triton {t_gl / t_tr:.3f} (vs 1 stage "
                      f"{t_gl / t_tr1:.3f}) | max|diff| {diff:.3e} | repeatable {same}")
        finally:
            (gd.GLUON_DV_LOCAL_WARPS, gd.GLUON_DV_LOCAL_TMA_STORE,
             gd.GLUON_DV_LOCAL_MAXNREG) = pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
