"""The fused TileLang forward against the Triton kernels it replaces (GPU only).

Per shape (bf16 inputs from ``common.make_gdn_inputs``, K = V = 128):

* ``forward``: Triton ``wy_fwd`` (A_inv, W, U) → ``chunk_state_fwd`` →
  ``chunk_output_fwd`` against Triton ``wy_fwd`` → the fused kernel with ``q``
  (``o`` and the final state; no ``W``, ``U``, ``h``, ``v_new`` in memory);
* ``recompute``: the state kernel storing ``h`` and ``v_new`` (what the backward
  rebuilds) against the fused kernel without ``q``;

with the largest relative difference from the Triton results and, on the
small shapes, both against the fp32 reference; whether two calls give the same
bits; whether a NaN planted in document 0 stays there (the other documents'
outputs bit-equal to a clean run). Times: ``common.time_fn`` medians (L2 flushed).

    python benchmarks/tilelang_fused_probe.py [--shapes 777:3:2:4,32768:8:16:16] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

D = 128


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _force_config() -> None:
    """``FUSED_CFG=stages`` pins the fused kernel's ring depth (to compare)."""
    spec = os.environ.get("FUSED_CFG")
    if spec:
        import gdn_core.ops.tilelang.fused_forward as ff

        ns = int(spec)
        ff.fused_forward_config = lambda K, V: {"stages": ns}


def _run_shape(T: int, docs: int, H: int, HV: int, iters: int) -> list[str]:
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.output import chunk_output_fwd
    from gdn_core.ops.tilelang.fused_forward import fused_chunk_fwd_tl
    from gdn_core.ops.wy import inverse_for_backward, wy_fwd
    from gdn_core.reference import chunk_gdn_reference

    shape = common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs, HV=HV)
    inp = common.make_gdn_inputs(shape, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    q, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    index = ChunkIndex.build(inp.offsets, "cuda")
    group = HV // H
    scale = D**-0.5
    h0 = torch.randn(index.num_docs, HV, D, D, device="cuda") * 0.1
    G = chunk_cumsum_fwd(g, index)

    def triton_fwd():
        _, W, U = wy_fwd(k, v, beta, G, index, group, output_A_inv=False)
        h, vn, fin = chunk_state_fwd(k, W, U, G, index, group, h0, output_final_state=True)
        return chunk_output_fwd(q, k, vn, h, G, scale, index, group), fin

    A_inv, W, U = wy_fwd(k, v, beta, G, index, group)
    A16 = inverse_for_backward(A_inv, k, v)
    del A_inv

    def fused_fwd(kk=k):
        A, _, _ = wy_fwd(kk, v, beta, G, index, group)  # (its W, U unused: the same kernel)
        o, _, _, fin = fused_chunk_fwd_tl(q, kk, v, inverse_for_backward(A, kk, v), G, beta,
                                          scale, index, group, h0, output_final_state=True)
        return o, fin

    def fused_only(kk=k, a=A16):
        o, _, _, fin = fused_chunk_fwd_tl(q, kk, v, a, G, beta, scale, index, group, h0,
                                          output_final_state=True)
        return o, fin

    def fused_chain():
        return fused_chunk_fwd_tl(None, k, v, A16, G, beta, scale, index, group, h0,
                                  output_final_state=True)[3]

    def triton_rec():
        return chunk_state_fwd(k, W, U, G, index, group, h0, output_final_state=False)

    def fused_rec():
        _, h, vn, _ = fused_chunk_fwd_tl(None, k, v, A16, G, beta, scale, index, group, h0,
                                         store_states=True, store_v_new=True)
        return h, vn

    def ms(fn) -> float:
        return common.time_fn(fn, device="cuda", warmup=3, iters=iters).median

    label = f"B1 T{T} H{H} HV{HV} docs={docs}"
    rows = []
    o_t, f_t = triton_fwd()
    o_l, f_l = fused_only()
    o_l2, f_l2 = fused_only()
    same = torch.equal(o_l, o_l2) and torch.equal(f_l, f_l2)
    ref = ""
    if T <= 4096:
        cu = torch.tensor(inp.offsets, device="cuda")
        o_r, f_r = chunk_gdn_reference(q[None].float(), k[None].float(), v[None].float(),
                                       g[None].float(), beta[None].float(), scale, h0, True, cu)
        ref = (f"; vs fp32 ref: fused o {_rel(o_l, o_r[0]):.1e} final {_rel(f_l, f_r):.1e}, "
               f"triton o {_rel(o_t, o_r[0]):.1e} final {_rel(f_t, f_r):.1e}")
    t_tri, t_fus, t_fo = ms(triton_fwd), ms(fused_fwd), ms(fused_only)
    rows.append(f"| {label} | forward (wy + state + output) | {t_tri:.3f} | {t_fus:.3f} "
                f"(fused kernel alone {t_fo:.3f}) | {t_tri / t_fus:.2f} | o {_rel(o_l, o_t):.1e}, "
                f"final {_rel(f_l, f_t):.1e}{ref} | {same} |")
    h_t, vn_t, _ = triton_rec()
    h_l, vn_l = fused_rec()
    h_l2, vn_l2 = fused_rec()
    same_r = torch.equal(h_l, h_l2) and torch.equal(vn_l, vn_l2)
    t_tr, t_fr, t_ch = ms(triton_rec), ms(fused_rec), ms(fused_chain)
    rows.append(f"| {label} | recompute h, v_new | {t_tr:.3f} | {t_fr:.3f} (final state "
                f"only {t_ch:.3f}) | {t_tr / t_fr:.2f} "
                f"| h {_rel(h_l, h_t):.1e}, v_new {_rel(vn_l, vn_t):.1e} | {same_r} |")
    if docs >= 2:  # a NaN in document 0's last key: the other documents must not see it
        offs = inp.offsets
        bad = k.clone()
        bad[offs[1] - 1, 0, 0] = float("nan")
        o_n, f_n = fused_only(bad)
        rest = slice(offs[1], None)
        contained = torch.equal(o_n[rest], o_l[rest]) and torch.equal(f_n[1:], f_l[1:])
        rows.append(f"| {label} | NaN in doc 0 | | | | others bit-equal: {contained} | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="777:3:2:4,8192:1:16:16,32768:8:16:16,"
                        "65536:16:16:16,32768:8:16:32", help="T:docs:H:HV, comma separated")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    _force_config()
    print(f"config: {os.environ.get('FUSED_CFG', 'pinned')}")
    print("| shape | what | triton ms | fused ms | speed-up | fused vs triton | repeatable |")
    print("|---|---|---|---|---|---|---|", flush=True)
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
