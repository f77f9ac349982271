"""Timing probe: the backward's recompute in one Gluon launch against the Triton pair (GPU).

The backward's first launches (:func:`gdn_core.segment.segment_bwd_begin`) at B1 T32768
K=V=128 bf16 with 1 and 8 documents (``common.make_gdn_inputs``), cut into segments of
4096 (``--segment``), ``--heads`` key heads and ``--group`` value heads per key head: the
forward's 16-bit inverse from :func:`~gdn_core.ops.wy.wy_fwd`, random fp32 entry states.
Times :func:`~gdn_core.ops.wy.wy_apply` + :func:`~gdn_core.ops.chunk_state.chunk_state_fwd`
(``h``, ``v_new`` stored; each alone and together) against
:func:`~gdn_core.ops.gluon.recompute.chunk_recompute_gluon`; ``common.time_fn``: CUDA-event
medians of 20 after 3 warm-ups. Prints ms, the ratio, whether ``W``, ``h`` and ``v_new`` are
bitwise the pair's (else the largest |difference|) and whether two calls give the same bits::

    python benchmarks/gluon_recompute_probe.py [--tokens 32768] [--docs 1,8] \
        [--segment 4096] [--heads 16] [--group 1]

On a machine without an sm_90 GPU with Gluon it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

D = 128


def _problem(T: int, docs: int, segment: int, H: int, group: int) -> dict:
    """The recompute's inputs over the segment-level chunk table."""
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd
    from gdn_core.segment import SegmentLayout

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs,
                                                 HV=H * group),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    _, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    layout = SegmentLayout.build(inp.offsets, segment)
    index = layout.index("cuda")
    G = chunk_cumsum_fwd(g, index)
    A_inv, _, _ = wy_fwd(k, v, beta, G, index, group, A_inv_for_backward=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    h0 = torch.randn(index.num_docs, H * group, D, D, generator=gen, device="cuda") * 0.05
    return dict(k=k, v=v, beta=beta, G=G, A_inv=A_inv, index=index, h0=h0, group=group)


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "bits equal"
    return f"max|diff| {(a.float() - b.float()).abs().max().item():.3e}"


def _probe(p: dict, docs: int, timed) -> None:
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.gluon.recompute import chunk_recompute_gluon
    from gdn_core.ops.wy import wy_apply

    k, v, beta, G, A_inv, index, h0, group = (p[x] for x in ("k", "v", "beta", "G", "A_inv",
                                                             "index", "h0", "group"))
    apply = functools.partial(wy_apply, k, v, beta, G, A_inv, index, group)

    def state(W, U):
        return chunk_state_fwd(k, W, U, G, index, group, initial_state=h0,
                               output_final_state=False, store_states=True)

    def pair():
        W, U = apply()
        h, v_new, _ = state(W, U)
        return W, h, v_new

    def one():
        return chunk_recompute_gluon(k, v, beta, G, A_inv, index, group, initial_state=h0)

    W, U = apply()
    t_apply, t_state = timed(apply), timed(functools.partial(state, W, U))
    del W, U
    want = pair()
    t_pair = timed(pair)
    got, again = one(), one()
    same = all(torch.equal(a, b) for a, b in zip(got, again))
    t = timed(one)
    diffs = " | ".join(f"{n} {_diff(a, b)}" for n, a, b in zip(("W", "h", "v_new"), got, want))
    print(f"D{docs} ({index.num_docs} segments x {k.shape[1] * group} heads): wy_apply "
          f"{t_apply:.4f} + state {t_state:.4f} ms, together {t_pair:.4f} | gluon recompute "
          f"{t:.4f} ms, ratio {t / t_pair:.3f} | {diffs} | repeatable {same}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--segment", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--group", type=int, default=1)
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops import gluon

    if not torch.cuda.is_available() or not gluon.available():
        print("gluon_recompute_probe: needs an sm_90 GPU with Gluon; nothing timed")
        return 2
    import triton

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 T{args.tokens} "
          f"H{args.heads} HV{args.heads * args.group} K=V={D} bf16, segments of "
          f"{args.segment}")

    def timed(fn) -> float:
        return common.time_fn(fn, device="cuda", warmup=3, iters=20).median

    for docs in (int(x) for x in args.docs.split(",")):
        _probe(_problem(args.tokens, docs, args.segment, args.heads, args.group), docs, timed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
