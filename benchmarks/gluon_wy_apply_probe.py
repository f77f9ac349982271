"""Timing probe: the Gluon WY apply kernel against the pinned Triton one (GPU only).

Times :func:`gdn_core.ops.wy.wy_apply` (Triton, the pinned configuration) and
:func:`gdn_core.ops.gluon.wy.wy_apply_gluon` (the backward's W, U from the stored
inverse) on the benchmark's bf16 inputs (``common.make_gdn_inputs``) at B1 T32768 H16
K=V=128 with 1 and 8 documents: ``G`` from :func:`chunk_cumsum_fwd`, the inverse the
backward reads (``inverse_for_backward`` of the Triton ``wy_fwd``'s: bf16;
``common.time_fn``: CUDA-event medians of 20 after 3 warm-ups; ``--flush-l2`` flushes L2
between iterations). Prints ms per call, the ratio, the effective bandwidth (K, V, A_inv
read, W, U written once), the largest |difference| of ``W``, ``U`` between the two, and
whether two Gluon calls give the same bits; the Gluon kernel at 4 warps (the launcher's),
8, and 4 capped at 96 registers (``--configs``: ``warps[:maxnreg]``, comma-separated).
Needs Triton 3.6's Gluon and an sm_90 GPU::

    python benchmarks/gluon_wy_apply_probe.py [--tokens 32768] [--docs 1,8]
        [--configs 4,8,4:96] [--flush-l2]

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
    """Inputs of the WY apply stage, as ``gluon_wy_probe._problem`` builds the forward's,
    and the bf16 inverse the backward reads."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import inverse_for_backward, wy_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    index = ChunkIndex.build(inp.offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    A_inv = inverse_for_backward(wy_fwd(k, v, beta, G, index, 1)[0], k, v)
    return dict(k=k, v=v, beta=beta, G=G, A_inv=A_inv, index=index, group=1)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--flush-l2", action="store_true")
    parser.add_argument("--configs", default="4,8,4:96",
                        help="Gluon configurations to time, warps[:maxnreg] (4: the launcher's "
                             "one warpgroup; 8: two; 4:96: 4 warps capped at 96 registers)")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_wy_apply_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import triton
    from gdn_core.ops.gluon import wy as gw
    from gdn_core.ops.wy import wy_apply

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{H} K=V={D} bf16, bf16 A_inv, flush_l2={args.flush_l2}")

    def time(fn) -> float:
        return common.time_fn(fn, device="cuda", warmup=3, iters=20,
                              flush_l2=args.flush_l2).median

    configs = []
    for c in args.configs.split(","):
        warps, _, cap = c.partition(":")
        configs.append((int(warps), int(cap) if cap else None))
    for docs in (int(x) for x in args.docs.split(",")):
        p = _problem(args.tokens, docs)
        call = (p["k"], p["v"], p["beta"], p["G"], p["A_inv"], p["index"], p["group"])
        # K, V, A_inv read and W, U written once (β, G: small)
        nbytes = sum(p[n].numel() * p[n].element_size() for n in ("k", "v", "A_inv")) \
            + 2 * p["v"].numel() * p["v"].element_size()
        ref = wy_apply(*call)
        t_tr = time(lambda c=call: wy_apply(*c))
        print(f"D{docs}: triton {t_tr:.4f} ms ({nbytes / t_tr / 1e9:.0f} GB/s; "
              f"max|W| {ref[0].float().abs().max().item():.3e})")
        pinned = gw.GLUON_WY_APPLY_WARPS, gw.GLUON_WY_APPLY_MAXNREG
        try:
            for warps, cap in configs:
                gw.GLUON_WY_APPLY_WARPS, gw.GLUON_WY_APPLY_MAXNREG = warps, cap
                out = gw.wy_apply_gluon(*call)
                again = gw.wy_apply_gluon(*call)
                same = all(torch.equal(a, b) for a, b in zip(out, again))
                diffs = " ".join(f"{n} {_maxdiff(a, b):.3e}"
                                 for n, a, b in zip(("W", "U"), out, ref))
                t_gl = time(lambda c=call: gw.wy_apply_gluon(*c))
                print(f"D{docs}: gluon warps={warps} maxnreg={cap} {t_gl:.4f} ms "
                      f"({nbytes / t_gl / 1e9:.0f} GB/s) | gluon/triton {t_gl / t_tr:.3f} | "
                      f"max|diff| {diffs} | repeatable {same}")
        finally:
            gw.GLUON_WY_APPLY_WARPS, gw.GLUON_WY_APPLY_MAXNREG = pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
