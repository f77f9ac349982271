"""Issue 19: the state kernel on the chunk inverse against the ``W``/``U`` formulation (GPU).

Before issue 19 the forward ran ``wy_fwd`` (inverse, ``W``, ``U`` written) then a state
kernel reading ``W`` and ``U``; the backward recomputed both with ``wy_apply``. Now the
forward runs the inverse alone and the state kernel forms
``v_new = A_inv diag(β)(V − diag(e^G) K S)`` in its loop; the backward recomputes only
``W`` (variant ``"W"``, :func:`gdn_core.ops.wy.wy_w`) or nothing (variant ``"A_inv"``:
the state backward forms ``Wᵀ dV'`` itself), picked by
``gdn_core.ops.chunk_state_bwd.chunk_state_bwd_source``. The old formulation lives on
only here: the old state kernel (copied) and the old WY ``W``+``U`` kernel (rebuilt from
the library's phase routines).

At B1 T32768 H16 K=V=128 bf16 with 8 documents (the plain recurrence: 128 programs,
``BV = 64``) and B1 T8192 H16 one document (16 programs, ``BV = 32``):

1. kernels, CUDA-event medians of 20 after 3 warm-ups (``common.time_fn``, no L2
   flush): forward old (``wy`` inverse+W+U, old state) vs new (``wy`` inverse, new
   state); backward recompute old (W+U apply, old state) vs ``"W"`` (``wy_w``, new
   state) vs ``"A_inv"`` (new state alone); the state backward with ``W`` vs ``A_inv``;
   with the largest differences between old and new ``v_new`` and between the two
   state backwards' ``dh0`` (bf16 rounding only: they are the same algebra);
2. the whole deterministic step (``gdn_det_train.chunk_gdn_det_fwd`` + ``_bwd``, default
   segments) with each backward variant: median ms and a torch.profiler table of
   the kernels.

    python benchmarks/state_from_inverse.py                  # on the H200, < 3 minutes
    TRITON_INTERPRET=1 python benchmarks/state_from_inverse.py --check --device cpu

``--check`` runs everything once on a tiny problem, untimed (the plumbing, no GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gdn_core.ops.wy import _dot_rows, _load_inverse, _wy_invert  # noqa: E402

# ------------------------------------------- the old formulation (here only) --


@triton.jit
def _old_wy_kernel(k, v, beta, G, A_inv, W, U, chunk_start, chunk_len, H, HV,
                   GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
                   INVERT: tl.constexpr):
    """The pre-issue-19 WY kernel: phases 1–2 (``INVERT``), then ``W`` and ``U``."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // GROUP
    bos = tl.load(chunk_start + i_c).to(tl.int64)
    n = tl.load(chunk_len + i_c)
    t = tl.arange(0, 64)
    mt = t < n
    KS = H * K
    RS = HV * 64
    p_k = k + bos * KS + i_h * K
    p_a = A_inv + bos * RS + i_hv * 64
    g = tl.load(G + bos * HV + i_hv + t * HV, mask=mt, other=0.0)
    b = tl.load(beta + bos * HV + i_hv + t * HV, mask=mt, other=0.0).to(tl.float32)
    if INVERT:
        _wy_invert(p_a, RS, p_k, KS, g, b, t, n, K, BK, PREC)
    if DOT16:
        a = _load_inverse(p_a, RS, t, n, W.dtype.element_ty)
    else:
        a = _load_inverse(p_a, RS, t, n, tl.float32)
    _dot_rows(a, p_k, KS, W + bos * HV * K + i_hv * K, HV * K, b * tl.exp(g), t, mt, K, BK,
              PREC, DOT16)
    _dot_rows(a, v + bos * HV * V + i_hv * V, HV * V, U + bos * HV * V + i_hv * V, HV * V, b,
              t, mt, V, BV, PREC, DOT16)


# the pre-issue-19 state kernel, verbatim (6a312ef): V' = U − W S
@triton.jit
def _old_state_kernel(
    k,
    W,
    U,
    G,
    h0,
    h,
    v_new,
    ht,
    doc_offsets,
    doc_chunk_offsets,
    need,
    H,
    HV,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    VU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    H0_EYE: tl.constexpr,
    HAS_NEED: tl.constexpr,
    STORE_H: tl.constexpr,
    STORE_VNEW: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    PREC: tl.constexpr,
):
    # V: the state's width; VU: the columns that take U (the rest take zero).
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // GROUP
    if HAS_NEED:
        flags = tl.load(need + i_n)
        want_u = ((flags & 1) != 0) & (i_v * BV < VU)
        want_z = ((flags & 2) != 0) & (i_v * BV + BV > VU)
        if not (want_u | want_z):
            return
    bos = tl.load(doc_offsets + i_n).to(tl.int64)
    eos = tl.load(doc_offsets + i_n + 1).to(tl.int64)
    c0 = tl.load(doc_chunk_offsets + i_n).to(tl.int64)

    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mu = rv < VU
    m_kv = mk[:, None] & mv[None, :]
    s_off = rk[:, None] * V + rv[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0)
    if H0_EYE:
        S += tl.where(rk[:, None] == rv[None, :] - VU, 1.0, 0.0)

    KS = H * K
    n_chunks = tl.cdiv(eos - bos, BT)
    for ic in range(0, n_chunks):
        t0 = bos + ic * BT
        n = tl.minimum(eos - t0, BT).to(tl.int32)
        mt = rt < n
        if STORE_H:
            p_h = h + ((c0 + ic) * HV + i_hv) * K * V
            tl.store(p_h + s_off, S.to(h.dtype.element_ty), mask=m_kv)
        b_w = tl.load(
            W + (t0 + rt[:, None]) * HV * K + i_hv * K + rk[None, :],
            mask=mt[:, None] & mk[None, :],
            other=0.0,
        )
        b_u = tl.load(
            U + (t0 + rt[:, None]) * HV * VU + i_hv * VU + rv[None, :],
            mask=mt[:, None] & mu[None, :],
            other=0.0,
        ).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, S.to(b_w.dtype), input_precision=PREC)
        if STORE_VNEW:
            tl.store(
                v_new + (t0 + rt[:, None]) * HV * V + i_hv * V + rv[None, :],
                b_vn.to(v_new.dtype.element_ty),
                mask=mt[:, None] & mv[None, :],
            )
        p_g = G + t0 * HV + i_hv
        g_last = tl.load(p_g + (n - 1) * HV)
        b_g = tl.load(p_g + rt * HV, mask=mt, other=0.0)
        dec = tl.where(mt, tl.exp(tl.where(mt, g_last - b_g, 0.0)), 0.0)
        b_kt = tl.load(
            k + (t0 + rt[None, :]) * KS + i_h * K + rk[:, None],
            mask=mk[:, None] & mt[None, :],
            other=0.0,
        )
        b_vd = (b_vn * dec[:, None]).to(b_kt.dtype)
        S = S * tl.exp(g_last)
        S = tl.dot(b_kt, b_vd, S, input_precision=PREC)

    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, S, mask=m_kv)


def old_wy(k, v, beta, G, index, A_inv=None):
    """``(A_inv, W, U)`` the old way: one launch writing all three (``A_inv=None``,
    the old ``wy_fwd``) or ``W, U`` from a stored inverse (the old ``wy_apply``)."""
    from gdn_core.ops.wy import _dot16, wy_config

    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    invert = A_inv is None
    if invert:
        A_inv = torch.empty(T, HV, 64, dtype=torch.float32, device=k.device)
    W = torch.empty(T, HV, K, dtype=k.dtype, device=k.device)
    U = torch.empty(T, HV, V, dtype=v.dtype, device=k.device)
    cfg = wy_config(K, V)
    _old_wy_kernel[(index.num_chunks, HV)](
        k, v, beta, G, A_inv, W, U, index.chunk_start, index.chunk_len, H, HV,
        GROUP=HV // H, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"],
        PREC="ieee" if k.dtype == torch.float32 else "tf32", DOT16=_dot16(k, v),
        INVERT=invert, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return A_inv, W, U


def old_state(k, W, U, G, index):
    """``(h, v_new)`` the old way (the forward's launch: states and v_new stored)."""
    from gdn_core.ops.chunk_state import chunk_state_config

    T, H, K = k.shape
    HV, V = U.shape[1], U.shape[2]
    N, NT = index.num_docs, index.num_chunks
    h = torch.empty(NT, HV, K, V, dtype=k.dtype, device=k.device)
    v_new = torch.empty(T, HV, V, dtype=U.dtype, device=k.device)
    cfg = chunk_state_config(K, V, k.element_size(), programs=N * HV)
    _old_state_kernel[(triton.cdiv(V, cfg["BV"]), N, HV)](
        k, W, U, G, None, h, v_new, None, index.doc_offsets, index.doc_chunk_offsets, None,
        H, HV, GROUP=HV // H, K=K, V=V, VU=V, BT=index.chunk_size, BK=cfg["BK"],
        BV=cfg["BV"], USE_H0=False, H0_EYE=False, HAS_NEED=False, STORE_H=True,
        STORE_VNEW=True, STORE_FINAL=False,
        PREC="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return h, v_new


# ------------------------------------------------------------------ helpers --


@contextlib.contextmanager
def backward_variant(name: str) -> Iterator[None]:
    """The backward's ``W`` source patched to ``name`` (``"W"`` or ``"A_inv"``)."""
    from gdn_core.ops import chunk_state_bwd as mod

    pinned = mod.chunk_state_bwd_source
    mod.chunk_state_bwd_source = lambda K, V: name
    try:
        yield
    finally:
        mod.chunk_state_bwd_source = pinned


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _kernels(args, T: int, docs: int) -> None:
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.dv_local import dv_local_bwd
    from gdn_core.ops.wy import inverse_for_backward, wy_fwd, wy_w

    half = torch.bfloat16 if args.device == "cuda" else torch.float16  # interpreter: no bf16
    shape = common.GDNShape(B=1, T=T, H=args.heads, K=128, V=128, D=docs)
    inp = common.make_gdn_inputs(shape, dtype=half, device=args.device, requires_grad=False)
    q, k, v, g, beta, do = (x[0].contiguous() for x in (*inp.leaves, inp.do))
    index = ChunkIndex.build(inp.offsets, args.device)
    G = chunk_cumsum_fwd(g, index)
    scale = 128 ** -0.5
    A32, _ = wy_fwd(k, beta, G, index, 1)
    A = inverse_for_backward(A32, k, v)
    dvl = dv_local_bwd(q, k, G, do, scale, index, 1)
    W = wy_w(k, beta, G, A, index, 1)

    def fwd_old():
        _, Wo, Uo = old_wy(k, v, beta, G, index)
        return old_state(k, Wo, Uo, G, index)

    def fwd_new():
        A_, _ = wy_fwd(k, beta, G, index, 1)
        return chunk_state_fwd(k, inverse_for_backward(A_, k, v), v, beta, G, index, 1)

    def rec_old():
        _, Wo, Uo = old_wy(k, v, beta, G, index, A_inv=A)
        return old_state(k, Wo, Uo, G, index)

    rows = {
        "fwd old: wy inverse+W+U": lambda: old_wy(k, v, beta, G, index),
        "fwd old: state (W, U)": lambda: old_state(k, W, U_old, G, index),
        "fwd new: wy inverse": lambda: wy_fwd(k, beta, G, index, 1),
        "fwd new: state (A_inv, v, beta)": lambda: chunk_state_fwd(k, A, v, beta, G, index, 1),
        "fwd old total (wy + state)": fwd_old,
        "fwd new total (wy + cast + state)": fwd_new,
        "bwd recompute old: apply W+U": lambda: old_wy(k, v, beta, G, index, A_inv=A),
        "bwd recompute old total": rec_old,
        "bwd recompute (a): wy_w": lambda: wy_w(k, beta, G, A, index, 1),
        "bwd state (a): W": lambda: chunk_state_bwd(q, k, W, G, do, dvl, None, scale, index,
                                                    1, dv=torch.empty_like(dvl)),
        "bwd state (b): A_inv": lambda: chunk_state_bwd(q, k, None, G, do, dvl, None, scale,
                                                        index, 1, dv=torch.empty_like(dvl),
                                                        A_inv=A, beta=beta),
    }
    _, W_old, U_old = old_wy(k, v, beta, G, index, A_inv=A)
    h_old, vn_old = old_state(k, W_old, U_old, G, index)
    h_new, vn_new, _ = chunk_state_fwd(k, A, v, beta, G, index, 1)
    _, _, dh0_a = rows["bwd state (a): W"]()
    _, _, dh0_b = rows["bwd state (b): A_inv"]()
    print(f"\n=== kernels B1 T{T} H{args.heads} K=V=128 {half} docs={docs}: "
          f"v_new new vs old rel max diff {_rel(vn_new, vn_old):.2e}, h {_rel(h_new, h_old):.2e}; "
          f"dh0 (b) vs (a) {_rel(dh0_b, dh0_a):.2e}; W old==wy_w {torch.equal(W_old, W)}",
          flush=True)
    times = {}
    for name, fn in rows.items():
        fn()
        if args.check:
            continue
        times[name] = common.time_fn(fn, device="cuda", warmup=3, iters=20,
                                     flush_l2=False).median
        print(f"  {name:40s} {times[name]:.3f} ms", flush=True)
    if times:
        a = times["bwd recompute (a): wy_w"] + times["fwd new: state (A_inv, v, beta)"] \
            + times["bwd state (a): W"]
        b = times["fwd new: state (A_inv, v, beta)"] + times["bwd state (b): A_inv"]
        o = times["bwd recompute old total"] + times["bwd state (a): W"]
        print(f"  backward state part (recompute + state bwd): old {o:.3f}, (a) {a:.3f}, "
              f"(b) {b:.3f} ms", flush=True)


def _step(args, T: int, docs: int) -> None:
    import gdn_det_train

    half = torch.bfloat16 if args.device == "cuda" else torch.float16
    shape = common.GDNShape(B=1, T=T, H=args.heads, K=128, V=128, D=docs)
    inp = common.make_gdn_inputs(shape, dtype=half, device=args.device, requires_grad=False)
    ins = inp.leaves

    def step():
        _, _, saved = gdn_det_train.chunk_gdn_det_fwd(*ins, cu_seqlens=inp.cu_seqlens)
        return gdn_det_train.chunk_gdn_det_bwd(saved, inp.do)

    grads = {}
    for variant in ("W", "A_inv"):
        with backward_variant(variant):
            grads[variant] = step()
            if args.check:
                continue
            ms = common.time_fn(step, device="cuda", warmup=3, iters=20, flush_l2=False).median
            print(f"\n=== step B1 T{T} H{args.heads} docs={docs} backward variant {variant!r}: "
                  f"fwd+bwd {ms:.3f} ms", flush=True)
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                            max_name_column_width=50), flush=True)
    a, b = grads["W"], grads["A_inv"]
    diffs = [f"{n} {_rel(getattr(b, n), getattr(a, n)):.1e}"
             for n in ("dq", "dk", "dv", "dg", "dbeta")]
    print("  grads (b) vs (a): " + ", ".join(diffs), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--check", action="store_true", help="tiny problem, once, untimed")
    p.add_argument("--rows", type=int, default=14, help="rows of each profiler table")
    p.add_argument("--stages", default="kernels,step")
    args = p.parse_args()
    args.heads = 2 if args.check else 16
    cases = [(256, 3), (128, 1)] if args.check else [(32768, 8), (8192, 1)]
    for stage in args.stages.split(","):
        for T, docs in cases:
            (_kernels if stage == "kernels" else _step)(args, T, docs)


if __name__ == "__main__":
    main()
