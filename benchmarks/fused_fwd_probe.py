"""Timing probe: the forward's last phase as one fused kernel against the two Triton ones (GPU).

The segment path's last phase (:func:`gdn_core.segment.segment_fwd_finish`) at B1 T32768
H16 K=V=128 bf16 with 1 and 8 documents (``common.make_gdn_inputs``), cut into segments of
4096 (``--segment``): ``W``/``U`` from :func:`wy_fwd` over the segment-level chunk table, and
random fp32 entry states (the fold's output; their values do not change the timing). Times
:func:`~gdn_core.ops.chunk_state.chunk_state_fwd` (``h``, ``v_new`` stored) +
:func:`~gdn_core.ops.output.chunk_output_fwd` (each alone and together) against
:func:`~gdn_core.ops.chunk_fwd_fused.chunk_fwd_fused` at its pinned configuration and at
each ``--variants`` override (``BV/num_warps/num_stages``); ``common.time_fn``: CUDA-event
medians of 20 after 3 warm-ups, ``--flush-l2`` flushes L2 between iterations. Prints ms,
fused/two-kernel ratio, whether ``o`` and the final state are bitwise the two-kernel path's
(else the largest |difference|), and whether two fused calls give the same bits.
``--gluon`` also times the warp-specialised Gluon fused forward
(:func:`~gdn_core.ops.gluon.fused_fwd.chunk_fwd_fused_gluon`, sm_90) against the pinned
Triton fused kernel, with the same comparisons::

    python benchmarks/fused_fwd_probe.py [--tokens 32768] [--docs 1,8] [--segment 4096] \
        [--variants 64/4/2,64/4/3,32/4/1] [--gluon] [--flush-l2]

On a machine without a CUDA GPU it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

H, D = 16, 128


def _problem(T: int, docs: int, segment: int) -> dict:
    """Inputs of the last phase, over the segment-level chunk table."""
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd
    from gdn_core.segment import SegmentLayout

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    layout = SegmentLayout.build(inp.offsets, segment)
    index = layout.index("cuda")
    G = chunk_cumsum_fwd(g, index)
    _, W, U = wy_fwd(k, v, beta, G, index, 1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    h0 = torch.randn(index.num_docs, H, D, D, generator=gen, device="cuda") * 0.05
    return dict(q=q, k=k, W=W, U=U, G=G, index=index, h0=h0, scale=D ** -0.5)


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "bits equal"
    return f"max|diff| {(a.float() - b.float()).abs().max().item():.3e}"


def _probe(p: dict, docs: int, variants: list, timed, gluon: bool = False) -> None:
    """Time and compare the two paths on one problem; print a line per fused variant."""
    from gdn_core.ops import chunk_fwd_fused as fm
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.output import chunk_output_fwd

    q, k, W, U, G, index, h0, scale = (p[x] for x in ("q", "k", "W", "U", "G", "index", "h0",
                                                      "scale"))

    def state():
        return chunk_state_fwd(k, W, U, G, index, 1, h0, output_final_state=True,
                               store_states=True)

    def two():
        h, vn, fin = state()
        return chunk_output_fwd(q, k, vn, h, G, scale, index, 1), fin

    def fused():
        return fm.chunk_fwd_fused(q, k, W, U, G, scale, index, 1, initial_state=h0,
                                  output_final_state=True)

    h, vn, _ = state()
    o_two, fin_two = two()
    t_state = timed(state)
    t_out = timed(functools.partial(chunk_output_fwd, q, k, vn, h, G, scale, index, 1))
    del h, vn  # the partial above held them; two() makes its own
    t_two = timed(two)
    print(f"D{docs} ({index.num_docs} segments x {H} heads): state {t_state:.4f} ms + "
          f"output {t_out:.4f} ms; together {t_two:.4f} ms")
    try:
        for var in variants:
            fm.CONFIG_OVERRIDE = var
            o, fin = fused()
            again = fused()
            same = torch.equal(again[0], o) and torch.equal(again[1], fin)
            t = timed(fused)
            tag = "pinned" if var is None else "/".join(str(var[x]) for x in
                                                        ("BV", "num_warps", "num_stages"))
            print(f"D{docs}: fused {tag} {t:.4f} ms | fused/two {t / t_two:.3f} | o "
                  f"{_diff(o, o_two)} | final {_diff(fin, fin_two)} | repeatable {same}")
    finally:
        fm.CONFIG_OVERRIDE = None
    if gluon:
        from gdn_core.ops.gluon.fused_fwd import chunk_fwd_fused_gluon

        def ws():
            return chunk_fwd_fused_gluon(q, k, W, U, G, scale, index, 1, initial_state=h0,
                                         output_final_state=True)

        o_f, fin_f = fused()
        o, fin = ws()
        again = ws()
        same = torch.equal(again[0], o) and torch.equal(again[1], fin)
        t_f, t = timed(fused), timed(ws)
        print(f"D{docs}: gluon warp-specialised {t:.4f} ms | gluon/fused {t / t_f:.3f} | o "
              f"{_diff(o, o_f)} | final {_diff(fin, fin_f)} (against the pinned fused) | "
              f"repeatable {same}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--segment", type=int, default=4096)
    parser.add_argument("--variants", default="64/4/2,64/4/3,32/4/1",
                        help="fused BV/num_warps/num_stages overrides to time besides the pinned")
    parser.add_argument("--gluon", action="store_true",
                        help="also time the warp-specialised Gluon fused forward (sm_90)")
    parser.add_argument("--flush-l2", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_fwd_probe: needs a CUDA GPU; nothing timed")
        return 2
    common.import_workspace_module("gdn_core")
    import triton
    from gdn_core.ops.chunk_fwd_fused import chunk_fwd_fused_config

    pinned = chunk_fwd_fused_config(D, D)
    variants = [None] + [dict(zip(("BV", "num_warps", "num_stages"), map(int, v.split("/"))))
                         for v in args.variants.split(",") if v]
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{H} K=V={D} bf16, segments of {args.segment}, flush_l2={args.flush_l2}; fused "
          f"pinned BV/warps/stages {pinned['BV']}/{pinned['num_warps']}/{pinned['num_stages']}")

    def timed(fn) -> float:
        return common.time_fn(fn, device="cuda", warmup=3, iters=20,
                              flush_l2=args.flush_l2).median

    for docs in (int(x) for x in args.docs.split(",")):
        _probe(_problem(args.tokens, docs, args.segment), docs, variants, timed, args.gluon)
    return 0


if __name__ == "__main__":
    sys.exit(main())
