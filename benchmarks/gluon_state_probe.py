"""Timing probe: the Gluon chunk-state kernel against the pinned Triton one (GPU only).

Times :func:`gdn_core.ops.chunk_state.chunk_state_fwd` (Triton, the pinned configuration)
and :func:`gdn_core.ops.gluon.chunk_state.chunk_state_fwd_gluon` on the benchmark's bf16
inputs (``common.make_gdn_inputs``) at B1 T32768 H16 K=V=128 with 1 and 8 documents, ``W``
and ``U`` from :func:`wy_fwd`, as the forward calls it (``h`` and ``v_new`` stored, no
initial or final state; ``common.time_fn``: CUDA-event medians of 20 after 3 warm-ups;
``--flush-l2`` flushes L2 between iterations). Prints ms per call, the ratio, the largest
|difference| of ``h`` and ``v_new`` between the two, and whether two Gluon calls give the
same bits; the Gluon kernel at each ``--bv`` (0: the launcher's choice) and ``--stages``.
Needs Triton 3.6's Gluon and an sm_90 GPU::

    python benchmarks/gluon_state_probe.py [--tokens 32768] [--docs 1,8] \
        [--bv 0,32,64,128] [--stages 2,3] [--flush-l2]

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
    """Inputs of the state stage, as the forward builds them."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    index = ChunkIndex.build(inp.offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    _, W, U = wy_fwd(k, v, beta, G, index, 1)
    return dict(k=k, W=W, U=U, G=G, index=index, group=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--bv", default="0,32,64,128",
                        help="Gluon value blocks to time (0: the launcher's choice)")
    parser.add_argument("--stages", default="2,3", help="Gluon ring slots to time")
    parser.add_argument("--flush-l2", action="store_true")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_state_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import triton
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.gluon import chunk_state as gs

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{H} K=V={D} bf16, flush_l2={args.flush_l2}")
    for docs in (int(x) for x in args.docs.split(",")):
        p = _problem(args.tokens, docs)
        call = (p["k"], p["W"], p["U"], p["G"], p["index"], p["group"])
        h_tr, vn_tr, _ = chunk_state_fwd(*call)
        t_tr = common.time_fn(lambda c=call: chunk_state_fwd(*c), device="cuda", warmup=3,
                              iters=20, flush_l2=args.flush_l2).median
        print(f"D{docs}: triton {t_tr:.4f} ms (max|h| {h_tr.float().abs().max().item():.3e}, "
              f"max|v_new| {vn_tr.float().abs().max().item():.3e})")
        pinned = gs.GLUON_STATE_BV, gs.GLUON_STATE_STAGES
        try:
            for stages in (int(x) for x in args.stages.split(",")):
                for bv in (int(x) for x in args.bv.split(",")):
                    gs.GLUON_STATE_BV, gs.GLUON_STATE_STAGES = (bv or None), stages
                    h_gl, vn_gl, _ = gs.chunk_state_fwd_gluon(*call)
                    h2, vn2, _ = gs.chunk_state_fwd_gluon(*call)
                    same = torch.equal(h_gl, h2) and torch.equal(vn_gl, vn2)
                    dh = (h_gl.float() - h_tr.float()).abs().max().item()
                    dv = (vn_gl.float() - vn_tr.float()).abs().max().item()
                    t_gl = common.time_fn(lambda c=call: gs.chunk_state_fwd_gluon(*c),
                                          device="cuda", warmup=3, iters=20,
                                          flush_l2=args.flush_l2).median
                    print(f"D{docs}: gluon BV={bv or 'auto'} stages={stages} {t_gl:.4f} ms | "
                          f"gluon/triton {t_gl / t_tr:.3f} | max|dh| {dh:.3e} | "
                          f"max|dv_new| {dv:.3e} | repeatable {same}")
        finally:
            gs.GLUON_STATE_BV, gs.GLUON_STATE_STAGES = pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
