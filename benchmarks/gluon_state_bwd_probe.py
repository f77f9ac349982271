"""Timing probe: the Gluon reverse state recurrence against the pinned Triton one (GPU only).

Times :func:`gdn_core.ops.chunk_state_bwd.chunk_state_bwd` (Triton, the pinned
configuration) and :func:`gdn_core.ops.gluon.chunk_state_bwd.chunk_state_bwd_gluon` on
the benchmark's bf16 inputs (``common.make_gdn_inputs``) at B1 T32768 H16 K=V=128 with 1
and 8 documents, ``W`` and ``dv_local`` built by the stages as ``kernel_variants.py``
builds them, ``dht`` fp32 (``--no-dht``: none) (``common.time_fn``: CUDA-event medians
of 20 after 3 warm-ups; ``--flush-l2`` flushes L2 between iterations). Each call gets
fresh ``dv``/``dh`` buffers (``dv_local`` is not overwritten). Prints ms per call, the
ratio, the largest |difference| of ``dh``, ``dv`` and ``dh0`` between the two kernels
(relative to the largest |value|), and whether two Gluon calls give the same bits, for
each ``--configs`` entry ``BV:STAGES`` (default ``128:2`` (the launcher's), ``64:2``,
``64:3``). Needs Triton 3.6's Gluon and an sm_90 GPU::

    python benchmarks/gluon_state_bwd_probe.py [--tokens 32768] [--docs 1,8] \
        [--configs 128:2,64:2,64:3] [--flush-l2] [--no-dht]

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


def _problem(T: int, docs: int, with_dht: bool) -> dict:
    """Inputs of the state backward, as ``kernel_variants._problem`` builds them."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.dv_local import dv_local_bwd
    from gdn_core.ops.wy import wy_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta, do = (x[0].contiguous() for x in (*inp.leaves, inp.do))
    index = ChunkIndex.build(inp.offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    _, W, _ = wy_fwd(k, v, beta, G, index, 1)
    scale = D**-0.5
    dvl = dv_local_bwd(q, k, G, do, scale, index, 1)
    dht = (torch.randn(index.num_docs, H, D, D, device="cuda") * 0.1) if with_dht else None
    return dict(q=q, k=k, W=W, G=G, do=do, dv_local=dvl, dht=dht, scale=scale, index=index,
                group=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--configs", default="128:2,64:2,64:3",
                        help="Gluon BV:STAGES pairs (BV 128 = 8 warps, the launcher's; 64 = 4)")
    parser.add_argument("--flush-l2", action="store_true")
    parser.add_argument("--no-dht", action="store_true")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_state_bwd_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import triton
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.gluon import chunk_state_bwd as gs

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{H} K=V={D} bf16, dht={not args.no_dht}, flush_l2={args.flush_l2}")
    for docs in (int(x) for x in args.docs.split(",")):
        p = _problem(args.tokens, docs, not args.no_dht)
        call = tuple(p[n] for n in ("q", "k", "W", "G", "do", "dv_local", "dht", "scale",
                                    "index", "group"))
        tr = chunk_state_bwd(*call)
        t_tr = common.time_fn(lambda c=call: chunk_state_bwd(*c), device="cuda", warmup=3,
                              iters=20, flush_l2=args.flush_l2).median
        print(f"D{docs}: triton {t_tr:.4f} ms (max|dh| {tr[0].float().abs().max().item():.3e}, "
              f"max|dv| {tr[1].float().abs().max().item():.3e})")
        pinned = gs.GLUON_STATE_BWD_BV, gs.GLUON_STATE_BWD_STAGES
        try:
            for cfg in args.configs.split(","):
                gs.GLUON_STATE_BWD_BV, gs.GLUON_STATE_BWD_STAGES = (int(x) for x in cfg.split(":"))
                gl_out = gs.chunk_state_bwd_gluon(*call)
                again = gs.chunk_state_bwd_gluon(*call)
                same = all(torch.equal(a, b) for a, b in zip(gl_out, again))
                diffs = " ".join(f"{n} {_rel(a, b):.2e}" for n, a, b in
                                 zip(("dh", "dv", "dh0"), gl_out, tr))
                t_gl = common.time_fn(lambda c=call: gs.chunk_state_bwd_gluon(*c), device="cuda",
                                      warmup=3, iters=20, flush_l2=args.flush_l2).median
                print(f"D{docs}: gluon BV:STAGES={cfg} {t_gl:.4f} ms | gluon/triton "
                      f"{t_gl / t_tr:.3f} | rel max|diff| {diffs} | repeatable {same}")
        finally:
            gs.GLUON_STATE_BWD_BV, gs.GLUON_STATE_BWD_STAGES = pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
