"""Timing probe: the fused reverse state recurrence against dv_local + state backward (GPU only).

Times :func:`gdn_core.ops.dv_local.dv_local_bwd` followed by
:func:`gdn_core.ops.chunk_state_bwd.chunk_state_bwd` (the two Triton kernels the backward
runs today, ``dV'`` written over ``dv_local`` as there) and
:func:`gdn_core.ops.chunk_state_bwd_fused.chunk_state_bwd_fused` (one kernel, the local
``dV'`` computed inside) on the benchmark's bf16 inputs (``common.make_gdn_inputs``) at
B1 T32768 H16 K=V=128 with 8 and 1 documents, cut into segments of ``--segment-size``
tokens (default the repo's, 4096: the chunk table the reverse pass walks; 0: whole
documents), ``W`` built by the WY stage, ``dht`` fp32 (``--no-dht``: none)
(``common.time_fn``: CUDA-event medians of 20 after 3 warm-ups; ``--flush-l2`` flushes L2
between iterations). Prints ms per call of each kernel and of the pair, then for the
fused kernel's pinned configuration and each ``--variants`` entry ``BKL:STAGES`` (default
``128:3``: ``Pᵀ`` as one whole-K dot, three stages; the chained 64-wide wgmma of the pinned
``BKL = 64`` should accumulate in the same order, but only the GPU can say) its ms, the
fused/pair ratio, whether ``dh``, ``dV'`` and ``dh0`` are bitwise equal to the pair's
(else the largest |difference| relative to the largest |value|) and whether two fused
calls give the same bits::

    python benchmarks/fused_state_bwd_probe.py [--tokens 32768] [--docs 8,1] \
        [--segment-size 4096] [--variants 128:3] [--flush-l2] [--no-dht]

On a machine without CUDA it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

H, D = 16, 128


def _problem(T: int, docs: int, segment_size: int, with_dht: bool) -> dict:
    """Inputs of the two stages (as ``gluon_state_bwd_probe._problem``), on the segment
    table of ``segment_size``."""
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd
    from gdn_core.segment import SegmentLayout

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta, do = (x[0].contiguous() for x in (*inp.leaves, inp.do))
    index = SegmentLayout.build(inp.offsets, segment_size).index("cuda")
    G = chunk_cumsum_fwd(g, index)
    _, W, _ = wy_fwd(k, v, beta, G, index, 1)
    dht = (torch.randn(index.num_docs, H, D, D, device="cuda") * 0.1) if with_dht else None
    return dict(q=q, k=k, W=W, G=G, do=do, dht=dht, scale=D**-0.5, index=index, group=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _measure(p: dict, timed, variants: list[tuple[int, int]]) -> list[str]:
    """One problem's lines: the pair's timings, then per fused ``(BKL, stages)`` variant
    (``(0, 0)``: the pinned configuration) its time, ratio, bits against the pair and
    repeatability."""
    from gdn_core.ops import chunk_state_bwd_fused as fmod
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.dv_local import dv_local_bwd

    q, k, W, G, do, dht = (p[n] for n in ("q", "k", "W", "G", "do", "dht"))
    scale, index, group = p["scale"], p["index"], p["group"]
    HV = do.shape[1]
    buf = torch.empty_like(do)  # dv_local, then dV' over it (the backward's buffer)
    dh = torch.empty(index.num_chunks, HV, D, D, dtype=do.dtype, device=do.device)
    sdv, fdv, fdh = torch.empty_like(do), torch.empty_like(do), torch.empty_like(dh)

    def dvl():
        return dv_local_bwd(q, k, G, do, scale, index, group, out=buf)

    def state(dv_out):
        return chunk_state_bwd(q, k, W, G, do, buf, dht, scale, index, group, dh=dh, dv=dv_out)

    def pair():
        dvl()
        return state(buf)

    def fused():
        return fmod.chunk_state_bwd_fused(q, k, W, G, do, dht, scale, index, group, dh=fdh,
                                          dv=fdv)

    want = tuple(x.clone() for x in pair())
    t_dvl, t_pair = timed(dvl), timed(pair)
    dvl()
    t_state = timed(lambda: state(sdv))  # alone: dV' beside dv_local, not over it
    lines = [f"({index.num_docs} segments, {index.num_chunks} chunks): dv_local {t_dvl:.4f} + "
             f"state_bwd {t_state:.4f} ms | pair {t_pair:.4f} ms"]
    pinned = fmod.chunk_state_bwd_fused_config
    try:
        for bkl, stages in variants:
            if bkl:
                def config(*a, bkl=bkl, stages=stages):
                    return dict(pinned(*a), BKL=bkl, num_stages=stages)

                fmod.chunk_state_bwd_fused_config = config
            else:
                fmod.chunk_state_bwd_fused_config = pinned
            cfg = fmod.chunk_state_bwd_fused_config(D, D)
            got = tuple(x.clone() for x in fused())
            same = all(torch.equal(a, b) for a, b in zip(got, fused()))
            cmp = " ".join(f"{n} {'equal' if torch.equal(a, b) else f'rel {_rel(a, b):.2e}'}"
                           for n, a, b in zip(("dh", "dv", "dh0"), got, want))
            t_fused = timed(fused)
            lines.append(f"  fused BKL:STAGES={cfg['BKL']}:{cfg['num_stages']}"
                         f"{' (pinned)' if not bkl else ''} {t_fused:.4f} ms | fused/pair "
                         f"{t_fused / t_pair:.3f} | {cmp} | repeatable {same}")
    finally:
        fmod.chunk_state_bwd_fused_config = pinned
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="8,1")
    parser.add_argument("--segment-size", type=int, default=None,
                        help="segment length (default: the repo's DEFAULT_SEGMENT_SIZE; 0: none)")
    parser.add_argument("--variants", default="128:3",
                        help="fused BKL:STAGES variants timed after the pinned configuration "
                             "(BKL 128 = one whole-K dot for P^T; '' for none)")
    parser.add_argument("--flush-l2", action="store_true")
    parser.add_argument("--no-dht", action="store_true")
    args = parser.parse_args(argv)
    variants = [(0, 0)] + [tuple(int(x) for x in v.split(":"))
                           for v in args.variants.split(",") if v]
    if not torch.cuda.is_available():
        print("fused_state_bwd_probe: needs a CUDA GPU; nothing timed")
        return 2
    common.import_workspace_module("gdn_core")
    import triton
    from gdn_core.chunking import DEFAULT_SEGMENT_SIZE

    S = DEFAULT_SEGMENT_SIZE if args.segment_size is None else args.segment_size
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{H} K=V={D} bf16, segment_size={S}, dht={not args.no_dht}, "
          f"flush_l2={args.flush_l2}")

    def timed(fn) -> float:
        return common.time_fn(fn, device="cuda", warmup=3, iters=20,
                              flush_l2=args.flush_l2).median

    for docs in (int(x) for x in args.docs.split(",")):
        lines = _measure(_problem(args.tokens, docs, S, not args.no_dht), timed, variants)
        print(f"D{docs} " + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
