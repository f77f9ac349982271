"""Timing probe: the Gluon chunk-output kernel against the pinned Triton one (GPU only).

Times :func:`gdn_core.ops.output.chunk_output_fwd` (Triton, the pinned
configuration) and :func:`gdn_core.ops.gluon.output.chunk_output_fwd_gluon` on the
benchmark's bf16 inputs (``common.make_gdn_inputs``) at B1 T32768 H16 K=V=128 with 1
and 8 documents, ``v_new`` and ``h`` built by the forward stages as
``kernel_variants.py`` builds them (``common.time_fn``: CUDA-event medians of 20
after 3 warm-ups; ``--flush-l2`` flushes L2 between iterations). Prints ms per call,
the ratio and the largest |difference| between the two outputs, and whether two
Gluon calls give the same bits; the Gluon kernel at 4 warps (the launcher's) and 8
(``--warps``; two warpgroups splitting the value columns, compiled, never run yet).
Needs Triton 3.6's Gluon and an sm_90 GPU::

    python benchmarks/gluon_output_probe.py [--tokens 32768] [--docs 1,8] [--warps 4,8] [--flush-l2]

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
    """Inputs of the output stage, as ``kernel_variants._problem`` builds them."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    index = ChunkIndex.build(inp.offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    _, W, U = wy_fwd(k, v, beta, G, index, 1)
    h, v_new, _ = chunk_state_fwd(k, W, U, G, index, 1)
    return dict(q=q, k=k, v_new=v_new, h=h, G=G, scale=D**-0.5, index=index, group=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--flush-l2", action="store_true")
    parser.add_argument("--warps", default="4,8",
                        help="Gluon kernel warps to time (4: the launcher's pinned one warpgroup; "
                             "8: two warpgroups splitting the columns)")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_output_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import triton
    from gdn_core.ops.gluon import output as go
    from gdn_core.ops.gluon.output import chunk_output_fwd_gluon
    from gdn_core.ops.output import chunk_output_fwd

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{H} K=V={D} bf16, flush_l2={args.flush_l2}")
    for docs in (int(x) for x in args.docs.split(",")):
        p = _problem(args.tokens, docs)
        call = (p["q"], p["k"], p["v_new"], p["h"], p["G"], p["scale"], p["index"], p["group"])
        o_tr = chunk_output_fwd(*call)
        ref = o_tr.float().abs().max().item()
        t_tr = common.time_fn(lambda c=call: chunk_output_fwd(*c), device="cuda", warmup=3,
                              iters=20, flush_l2=args.flush_l2).median
        print(f"D{docs}: triton {t_tr:.4f} ms (max|o| {ref:.3e})")
        pinned = go.GLUON_OUTPUT_WARPS
        try:
            for warps in (int(x) for x in args.warps.split(",")):
                go.GLUON_OUTPUT_WARPS = warps
                o_gl = chunk_output_fwd_gluon(*call)
                same = torch.equal(o_gl, chunk_output_fwd_gluon(*call))
                diff = (o_gl.float() - o_tr.float()).abs().max().item()
                t_gl = common.time_fn(lambda c=call: chunk_output_fwd_gluon(*c), device="cuda",
                                      warmup=3, iters=20, flush_l2=args.flush_l2).median
                print(f"D{docs}: gluon warps={warps} {t_gl:.4f} ms | gluon/triton "
                      f"{t_gl / t_tr:.3f} | max|diff| {diff:.3e} | repeatable {same}")
        finally:
            go.GLUON_OUTPUT_WARPS = pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
