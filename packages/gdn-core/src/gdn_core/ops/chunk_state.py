"""Stage 3: the chunk-state recurrence, on the chunk inverse.

Per document, value head and block of value columns, walking the document's
chunks in order with the state ``S`` (``[K, BV]``) in fp32 registers::

    h_c    = S                                         (stored, input dtype)
    X      = β ⊙ (V − e^G ⊙ K S)                       (fp32, [64, BV])
    V'     = A_inv X                                   ("v_new"; = U − W S)
    S     ← exp(G_last) S + (K ⊙ exp(G_last − G))ᵀ V'

``A_inv`` is the chunk's ``[64, 64]`` inverse of :func:`~gdn_core.ops.wy.wy_fwd`
(``W = A_inv diag(β e^G) K`` and ``U = A_inv diag(β) V`` regrouped), so the
forward never writes ``W`` or ``U`` and the backward's recompute reads only
what the forward saved. For 16-bit inputs ``K S`` and ``A_inv X`` are native
16-bit dots (``S`` and ``X`` rounded to the input type, ``A_inv`` read in it —
an fp32 ``A_inv`` gives the same bits); fp32 inputs take IEEE fp32 dots. ``K``
is read twice per chunk, once as is and once transposed through swapped
pointer strides (no ``tl.trans``). Value columns past ``v``'s width take
``v = 0`` (``X = −β e^G K S``): with ``v = 0`` of width ``K`` and
``initial_state = I`` the kernel gives the chunk transition matrix ``M`` of
context parallelism. One program per (value block, document, value head); no
atomics.

Segment summaries (:mod:`gdn_core.segment`): with ``state_width = V + K`` and
``identity_state=True`` the state is ``[E | M]`` — columns ``[0, V)`` start
at zero and read ``v``, columns ``[V, V + K)`` start at the identity and take
``v = 0`` (never materialised) — so one launch returns every "document"'s
``(S_ext, M)``; ``need`` (one int per document: bit 0 the ``E`` columns, bit 1
the ``M`` columns) lets programs whose columns nobody reads return at once.
Every column block is its own program, so a block's bits do not depend on
which other blocks or documents the launch holds.

sm_90 (Triton 3.6 ptxas, bf16, K=V=128, the forward's launch): 174 registers
at ``BV = 32`` and 254 at ``BV = 64``, no spills (the ``W``/``U`` kernel it
replaces: 174, and 255 with a 4-byte spill); ``tools/sm90_report.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile
from gdn_core.ops.wy import _dot16, check_inverse

__all__ = ["chunk_state_fwd", "chunk_state_config"]


@triton.jit
def _chunk_state_fwd_kernel(
    k,
    A_inv,
    v,
    beta,
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
    DOT16: tl.constexpr,
):
    # V: the state's width; VU: the columns that read v (the rest take v = 0).
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
    dt = k.dtype.element_ty

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
        rows = t0 + rt
        b_k = tl.load(k + rows[:, None] * KS + i_h * K + rk[None, :],
                      mask=mt[:, None] & mk[None, :], other=0.0)
        b_a = tl.load(A_inv + rows[:, None] * (HV * BT) + i_hv * BT + rt[None, :],
                      mask=mt[:, None] & mt[None, :], other=0.0)
        b_v = tl.load(v + rows[:, None] * (HV * VU) + i_hv * VU + rv[None, :],
                      mask=mt[:, None] & mu[None, :], other=0.0)
        b_b = tl.load(beta + rows * HV + i_hv, mask=mt, other=0.0).to(tl.float32)
        p_g = G + t0 * HV + i_hv
        g_last = tl.load(p_g + (n - 1) * HV)
        b_g = tl.load(p_g + rt * HV, mask=mt, other=0.0)
        b_kt = tl.load(k + rows[None, :] * KS + i_h * K + rk[:, None],
                       mask=mk[:, None] & mt[None, :], other=0.0)
        # V' = A_inv diag(β) (V − diag(e^G) K S)  (= U − W S)
        b_ks = tl.dot(b_k, S.to(dt), input_precision=PREC)
        b_x = b_b[:, None] * (b_v.to(tl.float32) - tl.exp(b_g)[:, None] * b_ks)
        if DOT16:
            b_vn = tl.dot(b_a.to(dt), b_x.to(dt))
        else:
            b_vn = tl.dot(b_a.to(tl.float32), b_x, input_precision=PREC)
        if STORE_VNEW:
            tl.store(
                v_new + rows[:, None] * (HV * V) + i_hv * V + rv[None, :],
                b_vn.to(v_new.dtype.element_ty),
                mask=mt[:, None] & mv[None, :],
            )
        dec = tl.where(mt, tl.exp(tl.where(mt, g_last - b_g, 0.0)), 0.0)
        b_vd = (b_vn * dec[:, None]).to(dt)
        S = S * tl.exp(g_last)
        S = tl.dot(b_kt, b_vd, S, input_precision=PREC)

    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, S, mask=m_kv)


def chunk_state_config(K: int, V: int, elem_bytes: int = 2, programs: int = 0) -> dict[str, int]:
    """Pinned launch configuration of the state kernel for head dims ``K, V``.

    ``BK`` covers all of ``K`` (the state's rows live in one tile); ``BV``
    trades parallelism (programs = docs × HV × V/BV) against per-program work.
    The chunk loop is a serial chain (dot → v_new → dot), so the next chunks'
    tiles must already be in flight: with ``num_stages=3`` the pipeliner issues
    chunk ``c+2``'s ``A_inv``, ``v``, ``K`` and ``G`` copies while chunk ``c`` runs
    (with 2 they are issued after chunk ``c``'s dots and waited on at once).
    Three stages fit in shared memory for 16-bit inputs (``elem_bytes=2``) up
    to ``BK = 128``; fp32 inputs and ``BK = 256`` keep two.

    ``programs`` (documents × value heads of the launch): from 128 on, 16-bit
    inputs at ``BK = 128`` take ``BV = 64`` on 4 warps — on the H200 0.421 against
    0.457 ms at B1 T32768 H16 with 8 documents, where one document (16 programs)
    runs 0.66× as fast (``benchmarks/results/2026-12-01-h200-s7-fused-forward-probes.md``,
    ``…-s5-kernel-variants.txt``). Value columns are independent, so the bits
    are the same at either width: a document's result does not depend on how
    many others share its launch (partition invariance).
    """
    BK = dot_tile(K, 256)
    if BK == 128 and elem_bytes <= 2 and V <= 128 and programs >= 128:
        return {"BK": BK, "BV": dot_tile(V, 64), "num_warps": 4, "num_stages": 3}
    BV = dot_tile(V, 32 if BK >= 128 else 64)
    num_warps = 4 if BK * BV <= 64 * 64 else 8
    stages = 3 if BK <= 128 and elem_bytes <= 2 else 2
    return {"BK": BK, "BV": BV, "num_warps": num_warps, "num_stages": stages}


@launcher(uses_atomics=False, kernels=(_chunk_state_fwd_kernel,))
def chunk_state_fwd(
    k: torch.Tensor,
    A_inv: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    index: ChunkIndex,
    group: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    store_states: bool = True,
    *,
    state_width: int | None = None,
    identity_state: bool = False,
    store_v_new: bool = True,
    need: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run the chunk-state recurrence over every document.

    Args:
        k: ``[T, H, K]`` keys (the ones used by :func:`~gdn_core.ops.wy.wy_fwd`),
            head ``hv // group`` serves value head ``hv``.
        A_inv: ``[T, HV, 64]`` per-chunk inverse from :func:`~gdn_core.ops.wy.wy_fwd`,
            fp32 or (16-bit inputs) in ``k``'s dtype
            (:func:`~gdn_core.ops.wy.inverse_for_backward`): the same bits either way.
        v: ``[T, HV, VU]`` values (any multiple of 16 up to 256).
        beta: ``[T, HV]`` write strengths.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g``.
        index: the chunk table (chunk size 64).
        group: value heads per key head.
        initial_state: ``[N, HV, K, V]`` (read as fp32) or ``None`` (zeros).
        output_final_state: return the state after each document.
        store_states: store the state entering each chunk.
        state_width: the state's width ``V`` (default ``VU``); columns
            ``[VU, V)`` take ``v = 0`` (never materialised). Only with
            ``store_states=False`` and ``store_v_new=False``.
        identity_state: start from ``[0 | I]`` (the identity in columns
            ``[VU, VU + K)``; needs ``V == VU + K`` and no ``initial_state``).
        store_v_new: store ``v_new`` (else ``None`` is returned for it).
        need: optional int32 ``[N]`` on the device: bit 0 — document ``n``'s
            columns ``[0, VU)`` are wanted, bit 1 — its columns ``[VU, V)``;
            programs of unwanted columns return at once (their outputs are
            left unwritten).

    Returns:
        ``(h, v_new, final)``: ``h: [NT, HV, K, V]`` in ``k``'s dtype (or
        ``None`` if not ``store_states``), ``v_new: [T, HV, V]`` in ``v``'s
        dtype (or ``None``), ``final: [N, HV, K, V]`` fp32 (or ``None``). A
        zero-length document's final state is its initial state (or zeros).
    """
    T, H, K = k.shape
    HV, VU = v.shape[1], v.shape[2]
    V = VU if state_width is None else int(state_width)
    N, NT = index.num_docs, index.num_chunks
    if (
        v.shape[0] != T
        or HV != H * group
        or tuple(beta.shape) != (T, HV)
        or tuple(G.shape) != (T, HV)
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}, "
            f"G {tuple(G.shape)}, group {group}, index tokens {index.total_tokens}"
        )
    check_inverse(A_inv, k, HV)
    if index.chunk_size != 64:
        raise ValueError(f"the state kernel reads the 64-row chunk inverse: chunk size must "
                         f"be 64, got {index.chunk_size}")
    for name, d in (("K", K), ("V", VU)):
        if d % 16 != 0 or not 16 <= d <= 256:
            raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")
    if V != VU:
        if V < VU or V > 512 or V % 16:
            raise ValueError(f"state_width must be a multiple of 16 in [{VU}, 512], got {V}")
        if store_states or store_v_new:
            raise ValueError("state_width != v's width only computes final states: pass "
                             "store_states=False and store_v_new=False")
    if identity_state:
        if V != VU + K or initial_state is not None:
            raise ValueError("identity_state needs state_width == v's width + K and no "
                             "initial_state")
    if need is not None and (need.dtype != torch.int32 or tuple(need.shape) != (N,)):
        raise ValueError(f"need must be int32 [N={N}], got {need.dtype} {tuple(need.shape)}")
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, "
                f"got {tuple(initial_state.shape)}"
            )
        initial_state = initial_state.to(torch.float32).contiguous()
    k, A_inv, v, beta, G = (x.contiguous() for x in (k, A_inv, v, beta, G))
    if G.dtype != torch.float32:
        G = G.float()
    dev = k.device
    h = torch.empty(NT, HV, K, V, dtype=k.dtype, device=dev) if store_states else None
    v_new = torch.empty(T, HV, V, dtype=v.dtype, device=dev) if store_v_new else None
    final = None
    if output_final_state:
        final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if N == 0 or HV == 0:
        return h, v_new, final
    if T == 0:
        # every document is empty: nothing to walk, the state passes through.
        if final is not None:
            if initial_state is not None:
                final.copy_(initial_state)
            else:
                final.zero_()
                if identity_state:
                    final[..., VU:].copy_(torch.eye(K, dtype=torch.float32, device=dev))
        return h, v_new, final
    cfg = chunk_state_config(K, V, k.element_size(), programs=N * HV)
    grid = (triton.cdiv(V, cfg["BV"]), N, HV)
    _chunk_state_fwd_kernel[grid](
        k, A_inv, v, beta, G, initial_state, h, v_new, final, index.doc_offsets,
        index.doc_chunk_offsets, need, H, HV, GROUP=group, K=K, V=V, VU=VU,
        BT=index.chunk_size, BK=cfg["BK"], BV=cfg["BV"], USE_H0=initial_state is not None,
        H0_EYE=identity_state, HAS_NEED=need is not None, STORE_H=store_states,
        STORE_VNEW=store_v_new, STORE_FINAL=output_final_state,
        PREC="ieee" if k.dtype == torch.float32 else "tf32", DOT16=_dot16(k, v),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return h, v_new, final
