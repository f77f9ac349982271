"""Timing probe: the fused backward (the reverse recurrence and every chunk gradient in one
warp-specialised launch, :mod:`gdn_core.ops.gluon.fused_bwd`) against the two launches it
replaces (GPU only).

On the benchmark's bf16 inputs (``common.make_gdn_inputs``, K = V = 128, H = 16, one value
head per q/k head), with ``W``, ``A_inv`` from the WY forward and ``h``, ``v_new`` from the
state forward, ``dht`` fp32, times with ``triton.testing.do_bench`` (ms, median):

* ``pair``: ``fused_state_bwd_gluon`` (``store=True``: ``dh``, ``dV'``, ``dh0``) then
  ``chunk_grads_bwd_gluon`` (``dq``, ``dk`` in bf16, ``dv``, ``dβ``, ``dg``): the default
  path's last phase;
* ``fused``: ``fused_bwd_gluon`` on the same inputs; ``fused+L2``: with
  ``GLUON_FUSED_BWD_PREFETCH`` (the next chunk's Q and K hinted into L2).

and prints the ratio, whether the six results are bitwise equal (with the largest relative
difference of each that is not) and whether the fused call is repeatable. A shape is
``T:docs`` (``docs`` equal documents: the segment layout of the det path, whose segments of
4096 tokens are the kernels' documents, e.g. ``32768:8`` is one 32K document's 8 segments or
B4 T8192) or ``T:docs:ln`` (the benchmark's log-normal document lengths, the kernels on the
document layout: its longest document sets the launch); a last field ``gN`` gives N value
heads per q/k head (the pair's chunk gradients then sum each group in their CTA; the fused
kernel's fp32 per-value-head ``dq``/``dk`` go through ``group_reduce``). Needs Triton 3.6's
Gluon and an sm_90 GPU::

    python benchmarks/gluon_fused_bwd_probe.py \
        [--shapes 32768:8,65536:16,32768:8:g2,32768:8:ln,8192:2] [--stamps 32768:8]

``--variants SHAPE`` first times the register-budget variants (:func:`_variants`).
``--stamps SHAPE`` also runs the fused kernel once with its timer stamps and prints where a
chunk's time goes in partition G (µs, mean over every program's chunks but its first):
waiting for Q/K and ``dS16`` | the ``X``/``dv_local`` step | phase A | phase B | phase C |
phase D | the dg/dβ stores, and the chunk period.

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
NAMES = ("dq", "dk", "dv", "dbeta", "dg", "dh0")


def _problem(T: int, docs: int, lognormal: bool, group: int = 1) -> dict:
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import inverse_for_backward, wy_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, HV=H * group, K=D, V=D,
                                                 D=docs if lognormal else 1),
                                 dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta, do = (x[0].contiguous() for x in (*inp.leaves, inp.do))
    offsets = inp.offsets if lognormal else [T * i // docs for i in range(docs + 1)]
    index = ChunkIndex.build(offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    A_inv, W, U = wy_fwd(k, v, beta, G, index, group)
    A_inv = inverse_for_backward(A_inv, k, v)  # the 16-bit copy the backward reads
    h, v_new, _ = chunk_state_fwd(k, W, U, G, index, group, initial_state=None,
                                  output_final_state=False, store_states=True)
    dht = torch.randn(index.num_docs, H * group, D, D, device="cuda") * 0.1
    return dict(q=q, k=k, v=v, v_new=v_new, h=h, W=W, do=do, G=G, beta=beta, A_inv=A_inv,
                dht=dht, scale=D**-0.5, index=index, g_dtype=g.dtype, group=group)


def _arms(p: dict) -> dict:
    from gdn_core.ops.gluon.chunk_grads import chunk_grads_bwd_gluon_summed
    from gdn_core.ops.gluon.fused_bwd import fused_bwd_gluon
    from gdn_core.ops.gluon.fused_state_bwd import fused_state_bwd_gluon
    from gdn_core.ops.group_reduce import group_reduce

    q, k, v, v_new, h, W, do, G, beta, A, dht = (p[n] for n in (
        "q", "k", "v", "v_new", "h", "W", "do", "G", "beta", "A_inv", "dht"))
    scale, index, g_dtype, group = p["scale"], p["index"], p["g_dtype"], p["group"]

    def pair():
        dh, dvp, dh0 = fused_state_bwd_gluon(q, k, W, G, do, dht, scale, index, group)
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        dq, dk, dv, dbeta, dg = chunk_grads_bwd_gluon_summed(
            q, k, v, v_new, h, dh, do, dvp, G, beta, A, scale, index, group, g_dtype, dq=dq,
            dk=dk)
        return dq, dk, dv, dbeta, dg, dh0

    def fused(prefetch: bool = False, stamps=None):
        from gdn_core.ops.gluon import fused_bwd as fb

        fb.GLUON_FUSED_BWD_PREFETCH = prefetch
        try:
            dq, dk, *rest = fused_bwd_gluon(q, k, v, v_new, h, W, do, G, beta, A, dht, scale,
                                            index, g_dtype, stamps=stamps)
        finally:
            fb.GLUON_FUSED_BWD_PREFETCH = False
        if group > 1:  # the per-value-head partials summed as the summed kernel does
            dq, dk = group_reduce(dq, group, q.dtype), group_reduce(dk, group, k.dtype)
        return dq, dk, *rest

    return {"pair": pair, "fused": fused, "fused+L2": lambda: fused(True)}


def _group(parts: list[str]) -> int:
    """The ``gN`` field of a shape (value heads per q/k head), 1 if absent."""
    return next((int(x[1:]) for x in parts[2:] if x.startswith("g")), 1)


STAGES = ("wait Q/K, dS16", "X, dv_local", "phase A", "phase B", "phase C", "phase D",
          "dg/dbeta")


def _stamps(shape: str, p: dict | None = None) -> str:
    """One stamped run of the fused kernel at ``T:docs[:ln]`` (on problem ``p`` if given):
    the mean µs of each interval between partition G's stamps and the mean chunk period."""
    parts = shape.split(":")
    if p is None:
        p = _problem(int(parts[0]), int(parts[1]), "ln" in parts[2:], _group(parts))
    programs = p["index"].num_docs * H * p["group"]
    buf = torch.zeros(programs * 512, dtype=torch.int64, device="cuda")
    _arms(p)["fused"](stamps=buf)
    torch.cuda.synchronize()
    n = min(64, p["index"].num_chunks // p["index"].num_docs)
    t = buf.view(programs, 64, 8)[:, :n].double()
    seg = (t[:, 1:, 1:] - t[:, 1:, :-1]) / 1e3  # chunks 1.. (the first has its loads alone)
    period = (t[:, 2:, 0] - t[:, 1:-1, 0]).mean().item() / 1e3
    return (f"{shape} stamps (µs a chunk, G): "
            + " | ".join(f"{name} {v:.2f}" for name, v in zip(STAGES, seg.mean((0, 1)).tolist()))
            + f" | period {period:.2f}")


def _variants(shape: str) -> list[str]:
    """Register-budget sensitivity at ``T:docs`` (group 1): the one-tile chunk-gradient
    kernel alone at its own budget (no cap: 244 registers) and capped at 200 and 168 (the
    fused kernel's G), and the fused kernel with S at 152 / 168 / 184 registers (G at
    176 / 168 / 160), each with its per-phase stamps. Loads or registers: which binds G."""
    import triton
    from gdn_core.ops.gluon import chunk_grads as gc
    from gdn_core.ops.gluon import fused_bwd as fb
    from gdn_core.ops.gluon.fused_state_bwd import fused_state_bwd_gluon

    parts = shape.split(":")
    p = _problem(int(parts[0]), int(parts[1]), False)
    q, k, v, v_new, h, W, do, G, beta, A, dht = (p[n] for n in (
        "q", "k", "v", "v_new", "h", "W", "do", "G", "beta", "A_inv", "dht"))
    scale, index, g_dtype = p["scale"], p["index"], p["g_dtype"]
    dh, dvp, _ = fused_state_bwd_gluon(q, k, W, G, do, dht, scale, index, 1)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    outs, (descs, G32, beta_c) = gc.prepare_launch(q, k, v, v_new, h, dh, do, dvp, G, beta, A,
                                                   index, 1, g_dtype, dq, dk, None, None, None)
    lines = []
    want = None
    for cap in (None, 200, 168):
        def grads(cap=cap):
            gc._chunk_grads_bwd_gluon_kernel[(index.num_chunks, H)](
                *descs.values(), G32, beta_c, *outs, index.chunk_start, index.chunk_len,
                float(scale), H, outs[0], outs[1], 0, 0, GROUP=1, K=D, V=D, BT=64,
                SUM_GROUP=False, num_warps=8, **({} if cap is None else {"maxnreg": cap}))
            return [x.clone() for x in outs]
        got = grads()
        want = got if want is None else want
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ms = triton.testing.do_bench(grads, warmup=5, rep=50)
        lines.append(f"{shape} chunk grads alone, maxnreg {cap or 'none'}: {ms:.4f} ms "
                     f"(bits as uncapped: {'yes' if same else 'no'})")
    default = fb.GLUON_FUSED_BWD_S_REGS
    try:
        for s_regs in (152, 168, 184):
            fb.GLUON_FUSED_BWD_S_REGS = s_regs
            fused = _arms(p)["fused"]
            fused()
            ms = triton.testing.do_bench(fused, warmup=5, rep=50)
            lines.append(f"{shape} fused, S/G registers {s_regs}/{(504 - s_regs) // 16 * 8}: "
                         f"{ms:.4f} ms; " + _stamps(shape, p))
    finally:
        fb.GLUON_FUSED_BWD_S_REGS = default
    return lines


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32768:8,65536:16,32768:8:g2,32768:8:ln,8192:2",
                        help="T:docs[:ln] list")
    parser.add_argument("--stamps", default="", help="T:docs[:ln]: the per-phase breakdown")
    parser.add_argument("--variants", default="", help="T:docs: the register-budget runs")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_fused_bwd_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import triton

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, B1 H{H} K=V={D} bf16, "
          "dht fp32")
    for line in (_variants(args.variants) if args.variants else []):
        print(line, flush=True)
    for shape in filter(None, args.shapes.split(",")):
        parts = shape.split(":")
        T, docs, ln, group = int(parts[0]), int(parts[1]), "ln" in parts[2:], _group(parts)
        arms = _arms(_problem(T, docs, ln, group))
        outs = {name: fn() for name, fn in arms.items()}
        torch.cuda.synchronize()
        ms = {name: triton.testing.do_bench(fn, warmup=5, rep=50) for name, fn in arms.items()}
        again = arms["fused"]()
        same = all(torch.equal(a, b) for a, b in zip(outs["fused"], again, strict=True))
        line = [f"T{T} D{docs}{' lognormal' if ln else ''} HV{H * group}: "
                + " | ".join(f"{n} {t:.4f} ms" for n, t in ms.items())]
        for arm in ("fused", "fused+L2"):
            diff = [f"{n} {_rel(a, b):.2e}" for n, a, b in
                    zip(NAMES, outs[arm], outs["pair"], strict=True) if not torch.equal(a, b)]
            line.append(f"{arm}/pair {ms[arm] / ms['pair']:.3f} bits-equal "
                        f"{'yes' if not diff else 'no (' + ', '.join(diff) + ')'}")
        line.append(f"repeatable {'yes' if same else 'no'}")
        print(" | ".join(line), flush=True)
    if args.stamps:
        print(_stamps(args.stamps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
