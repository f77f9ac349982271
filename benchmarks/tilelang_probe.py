"""The TileLang state kernel against the Triton kernels it would replace (GPU only).

On the benchmark's bf16 inputs (``common.make_gdn_inputs``, K = V = 128), per shape:

* ``triton state+output``: :func:`~gdn_core.ops.chunk_state.chunk_state_fwd` then
  :func:`~gdn_core.ops.output.chunk_output_fwd` (the forward's pair today);
* ``tilelang state+output``: :func:`~gdn_core.ops.tilelang.state_output.chunk_state_output_fwd_tl`
  with ``q`` (one kernel, no states in HBM);
* ``triton state`` / ``tilelang state``: the recurrence alone storing ``h`` and ``v_new``
  (what the backward recomputes);

each timed with ``common.time_fn`` (CUDA-event medians, no L2 flush), with the largest
relative difference of the TileLang results from the Triton ones, whether two TileLang
calls give the same bits, and whether a NaN planted in one document's keys stays in that
document (the other documents' outputs bit-equal to a clean run).

    python benchmarks/tilelang_probe.py [--shapes 32768:8,8192:2] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

D = 128


def _problem(T: int, docs: int, H: int, HV: int) -> dict:
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd

    shape = common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs, HV=HV)
    inp = common.make_gdn_inputs(shape, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    index = ChunkIndex.build(inp.offsets, "cuda")
    G = chunk_cumsum_fwd(g, index)
    group = HV // H
    _, W, U = wy_fwd(k, v, beta, G, index, group)
    h0 = torch.randn(index.num_docs, HV, D, D, device="cuda") * 0.1
    return dict(q=q, k=k, W=W, U=U, G=G, index=index, group=group, h0=h0, offsets=inp.offsets)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _run_shape(T: int, docs: int, H: int, HV: int, iters: int) -> list[str]:
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.output import chunk_output_fwd
    from gdn_core.ops.tilelang.state_output import chunk_state_output_fwd_tl

    p = _problem(T, docs, H, HV)
    q, k, W, U, G, index, group, h0 = (p[x] for x in ("q", "k", "W", "U", "G", "index", "group",
                                                       "h0"))
    scale = D**-0.5

    def tri_pair():
        h, vn, fin = chunk_state_fwd(k, W, U, G, index, group, h0, output_final_state=True)
        return chunk_output_fwd(q, k, vn, h, G, scale, index, group), fin

    def tl_fused(kk=k):
        o, _, _, fin = chunk_state_output_fwd_tl(q, kk, W, U, G, scale, index, group, h0,
                                                 output_final_state=True)
        return o, fin

    def tri_state():
        return chunk_state_fwd(k, W, U, G, index, group, h0, output_final_state=True)

    def tl_state():
        _, h, vn, fin = chunk_state_output_fwd_tl(None, k, W, U, G, scale, index, group, h0,
                                                  output_final_state=True, store_states=True,
                                                  store_v_new=True)
        return h, vn, fin

    def ms(fn) -> float:
        return common.time_fn(fn, device="cuda", warmup=3, iters=iters, flush_l2=False).median

    label = f"B1 T{T} H{H} HV{HV} docs={docs}"
    rows = []
    o_t, f_t = tri_pair()
    o_l, f_l = tl_fused()
    o_l2, f_l2 = tl_fused()
    same = torch.equal(o_l, o_l2) and torch.equal(f_l, f_l2)
    t_pair, t_fused = ms(tri_pair), ms(tl_fused)
    rows.append(f"| {label} | state+output | {t_pair:.3f} | {t_fused:.3f} | {t_pair / t_fused:.2f} "
                f"| o {_rel(o_l, o_t):.1e}, final {_rel(f_l, f_t):.1e} | {same} |")
    h_t, vn_t, fs_t = tri_state()
    h_l, vn_l, fs_l = tl_state()
    t_ts, t_ls = ms(tri_state), ms(tl_state)
    rows.append(f"| {label} | state (h, v_new) | {t_ts:.3f} | {t_ls:.3f} | {t_ts / t_ls:.2f} "
                f"| h {_rel(h_l, h_t):.1e}, v_new {_rel(vn_l, vn_t):.1e}, final "
                f"{_rel(fs_l, fs_t):.1e} | — |")
    if docs >= 2:  # a NaN in document 0's last key: the other documents must not see it
        offs = p["offsets"]
        bad = k.clone()
        bad[offs[1] - 1, 0, 0] = float("nan")
        o_n, f_n = tl_fused(bad)
        rest = slice(offs[1], None)
        contained = torch.equal(o_n[rest], o_l[rest]) and torch.equal(f_n[1:], f_l[1:])
        rows.append(f"| {label} | NaN in doc 0 | | | | others bit-equal: {contained} | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="32768:8:16:16,8192:2:16:16,65536:16:16:16,"
                        "32768:8:16:32", help="T:docs:H:HV, comma separated")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print("| shape | what | triton ms | tilelang ms | speed-up | tilelang vs triton | "
          "repeatable |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.shapes.split(","):
        T, docs, H, HV = (int(x) for x in spec.split(":"))
        try:
            for row in _run_shape(T, docs, H, HV, args.iters):
                print(row, flush=True)
        except Exception as exc:  # noqa: BLE001 - report the shape and go on
            print(f"| B1 T{T} H{H} HV{HV} docs={docs} | FAILED {type(exc).__name__}: "
                  f"{str(exc)[:300]} | | | | | |", flush=True)


if __name__ == "__main__":
    main()
