"""Timing probe: the warp-specialised fused state backward (dv_local inside the reverse
recurrence, :mod:`gdn_core.ops.gluon.fused_state_bwd`) against the pair it replaces (GPU only).

Times ``dv_local_bwd`` + ``chunk_state_bwd`` (the Triton pair, and the Gluon pair
``dv_local_bwd_gluon`` + ``chunk_state_bwd_gluon``) and ``fused_state_bwd_gluon`` with
``triton.testing.do_bench`` (ms, median) on the benchmark's bf16 inputs
(``common.make_gdn_inputs``) at B1 T32768 H16 K=V=128 with 1 and 8 documents, and B1 T8192
one document; ``W`` from ``wy_fwd``, ``dht`` fp32. Prints ms, the fused/pair ratios and
whether the fused kernel's ``dh``, ``dV'``, ``dh0`` are bitwise equal to each pair's
(yes/no, with the largest relative difference if not) and repeatable. A second line per
shape times the first pass of the segment backward (``store=False``: ``dh0`` only) with a
TMA ring of 2 and of 3 stages and says whether their ``dh0`` are bitwise equal. Needs Triton 3.6's
Gluon and an sm_90 GPU (about a minute with the compiles)::

    python benchmarks/gluon_fused_state_probe.py [--shapes 32768:1,32768:8,8192:1]

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
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta, do = (x[0].contiguous() for x in (*inp.leaves, inp.do))
    index = ChunkIndex.build(inp.offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    _, W, _ = wy_fwd(k, v, beta, G, index, 1)
    dht = torch.randn(index.num_docs, H, D, D, device="cuda") * 0.1
    return dict(q=q, k=k, W=W, G=G, do=do, dht=dht, scale=D**-0.5, index=index, group=1)


def _arms(p: dict) -> dict:
    """The three calls on problem ``p``: the Triton pair, the Gluon pair, the fused kernel."""
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.dv_local import dv_local_bwd
    from gdn_core.ops.gluon.chunk_state_bwd import chunk_state_bwd_gluon
    from gdn_core.ops.gluon.dv_local import dv_local_bwd_gluon
    from gdn_core.ops.gluon.fused_state_bwd import fused_state_bwd_gluon

    q, k, W, G, do, dht = (p[n] for n in ("q", "k", "W", "G", "do", "dht"))
    scale, index, group = p["scale"], p["index"], p["group"]

    def pair(dvl_fn, state_fn):
        dvl = dvl_fn(q, k, G, do, scale, index, group)
        return state_fn(q, k, W, G, do, dvl, dht, scale, index, group, dv=dvl)

    return {"triton pair": lambda: pair(dv_local_bwd, chunk_state_bwd),
            "gluon pair": lambda: pair(dv_local_bwd_gluon, chunk_state_bwd_gluon),
            "fused": lambda: fused_state_bwd_gluon(q, k, W, G, do, dht, scale, index, group)}


def _first_pass(p: dict) -> str:
    """``store=False`` at each ring depth: ms, the ratio and whether ``dh0`` is the same."""
    import triton
    from gdn_core.ops.gluon import fused_state_bwd as fs

    args = tuple(p[n] for n in ("q", "k", "W", "G", "do", "dht", "scale", "index", "group"))
    default = fs.GLUON_FUSED_STATE_FIRST_PASS_STAGES
    dh0, ms = {}, {}
    try:
        for st in (2, 3):
            fs.GLUON_FUSED_STATE_FIRST_PASS_STAGES = st

            def call():
                return fs.fused_state_bwd_gluon(*args, store=False)[2]

            dh0[st] = call()
            ms[st] = triton.testing.do_bench(call, warmup=5, rep=50)
    finally:
        fs.GLUON_FUSED_STATE_FIRST_PASS_STAGES = default
    return (f"stages 2 {ms[2]:.4f} ms | stages 3 {ms[3]:.4f} ms | 3/2 {ms[3] / ms[2]:.3f} | "
            f"dh0 bits-equal {'yes' if torch.equal(dh0[2], dh0[3]) else 'no'}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32768:1,32768:8,8192:1", help="T:documents list")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_fused_state_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import triton

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 H{H} K=V={D} bf16, "
          "dht fp32")
    for shape in args.shapes.split(","):
        T, docs = (int(x) for x in shape.split(":"))
        arms = _arms(_problem(T, docs))
        outs = {name: fn() for name, fn in arms.items()}
        torch.cuda.synchronize()
        ms = {name: triton.testing.do_bench(fn, warmup=5, rep=50) for name, fn in arms.items()}
        again = arms["fused"]()
        same = all(torch.equal(a, b) for a, b in zip(outs["fused"], again))
        line = [f"T{T} D{docs}: " + " | ".join(f"{n} {t:.4f} ms" for n, t in ms.items())]
        for ref in ("triton pair", "gluon pair"):
            eq = all(torch.equal(a, b) for a, b in zip(outs["fused"], outs[ref]))
            diff = "" if eq else " (" + " ".join(
                f"{n} {_rel(a, b):.2e}" for n, a, b in
                zip(("dh", "dv", "dh0"), outs["fused"], outs[ref])) + ")"
            line.append(f"fused/{ref} {ms['fused'] / ms[ref]:.3f} bits-equal "
                        f"{'yes' if eq else 'no'}{diff}")
        line.append(f"repeatable {'yes' if same else 'no'}")
        print(" | ".join(line), flush=True)
        print(f"T{T} D{docs} first pass: " + _first_pass(_problem(T, docs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
