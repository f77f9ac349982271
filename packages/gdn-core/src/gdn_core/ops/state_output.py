"""Stages 3 and 4 fused: the chunk-state recurrence and the chunk output.

Per document, value head and block of value columns, walking the document's
chunks in order with the state ``S`` (``[K, BV]``) in fp32 registers::

    V'  = U − W S                                               ("v_new")
    O   = scale · ( diag(exp G) Q S + (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j]) V' )
    S  ← exp(G_last) S + (K ⊙ exp(G_last − G))ᵀ V'

This is :func:`~gdn_core.ops.chunk_state.chunk_state_fwd` followed by
:func:`~gdn_core.ops.output.chunk_output_fwd` without the HBM round trip
between them: the states entering each chunk (``[NT, HV, K, V]``, twice the
size of ``q``) and ``V'`` are never written or read back. Each chunk's tiles
are loaded once and feed five dots; the loop is software-pipelined
(``num_stages``) so the next chunks' ``Q, K, W, U`` copies are in flight while
this chunk's dots run. The rounding is that of the two-kernel path (``S`` and
``V'`` enter the output dots rounded to the input type, as the stored ``h`` and
``v_new`` were), but the accumulation order of ``Q Kᵀ`` and ``Q S`` inside a
dot differs, so the bits are this kernel's own.

``Kᵀ`` is loaded through transposed pointer strides (no ``tl.trans``: see
:mod:`gdn_core.ops.tiles` on Triton 3.6's Hopper code). One program per
(value block, document, value head); no atomics, no autotuning — a program's
arithmetic depends only on its own document, so the bits do not depend on
which other documents share the launch (what partition invariance needs).

Status (H200, bf16, K=V=128, B1 T32768 H16 8 documents): 0.751 ms at its best
configuration against 0.752 ms for the two kernels, and 0.225 vs 0.181 ms at
T8192 with 2 documents, so the forward keeps the pair. ptxas puts every
configuration at 255 registers with spills, and the shared memory of 2–3
stages leaves one program per SM: the serial chunk loop then has nothing to
hide its latency behind, where the pair's output kernel runs one program per
chunk. What would make it pay: fewer live tiles (``Q Kᵀ`` precomputed by a
chunk-parallel kernel, as FlashQLA's forward has it) or warp specialisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile

__all__ = ["chunk_state_output_fwd", "state_output_config"]

# Shared memory a launch may use on sm_90 (227 KiB), less room for the layout
# conversions of the dot operands that Triton stages through shared memory.
_SHARED_BUDGET = 180 * 1024


@triton.jit
def _chunk_state_output_fwd_kernel(
    q,
    k,
    W,
    U,
    G,
    h0,
    o,
    ht,
    doc_offsets,
    scale,
    H,
    HV,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // GROUP
    bos = tl.load(doc_offsets + i_n).to(tl.int64)
    eos = tl.load(doc_offsets + i_n + 1).to(tl.int64)

    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    m_kv = mk[:, None] & mv[None, :]
    s_off = rk[:, None] * V + rv[None, :]
    causal = rt[:, None] >= rt[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0)

    KS = H * K
    n_chunks = tl.cdiv(eos - bos, BT)
    for ic in range(0, n_chunks):
        t0 = bos + ic * BT
        n = tl.minimum(eos - t0, BT).to(tl.int32)
        mt = rt < n
        m_tk = mt[:, None] & mk[None, :]
        m_tv = mt[:, None] & mv[None, :]
        b_w = tl.load(W + (t0 + rt[:, None]) * HV * K + i_hv * K + rk[None, :], mask=m_tk,
                      other=0.0)
        b_u = tl.load(U + (t0 + rt[:, None]) * HV * V + i_hv * V + rv[None, :], mask=m_tv,
                      other=0.0).to(tl.float32)
        b_q = tl.load(q + (t0 + rt[:, None]) * KS + i_h * K + rk[None, :], mask=m_tk, other=0.0)
        b_kt = tl.load(k + (t0 + rt[None, :]) * KS + i_h * K + rk[:, None],
                       mask=mk[:, None] & mt[None, :], other=0.0)
        p_g = G + t0 * HV + i_hv
        b_g = tl.load(p_g + rt * HV, mask=mt, other=0.0)
        g_last = tl.load(p_g + (n - 1) * HV)

        s_in = S.to(b_w.dtype)  # the state entering the chunk, as the output reads it
        b_vn = b_u - tl.dot(b_w, s_in, input_precision=PREC)
        b_vc = b_vn.to(b_w.dtype)
        # output: the inter-chunk part from the entering state, the intra-chunk part from V'
        b_o = tl.dot(b_q, s_in.to(b_q.dtype), input_precision=PREC) * tl.exp(b_g)[:, None]
        b_a = tl.dot(b_q, b_kt, input_precision=PREC)
        keep = causal & mt[:, None]
        b_a = tl.where(keep, b_a * tl.exp(tl.where(keep, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
        b_o = tl.dot(b_a.to(b_vc.dtype), b_vc, b_o, input_precision=PREC)
        tl.store(o + (t0 + rt[:, None]) * HV * V + i_hv * V + rv[None, :],
                 (b_o * scale).to(o.dtype.element_ty), mask=m_tv)
        # state update
        dec = tl.where(mt, tl.exp(tl.where(mt, g_last - b_g, 0.0)), 0.0)
        b_vd = (b_vn * dec[:, None]).to(b_kt.dtype)
        S = S * tl.exp(g_last)
        S = tl.dot(b_kt, b_vd, S, input_precision=PREC)

    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, S, mask=m_kv)


def state_output_config(K: int, V: int, elem_bytes: int = 2) -> dict[str, int]:
    """Pinned launch configuration of the fused kernel for head dims ``K, V``.

    ``BK`` covers all of ``K`` (the state's rows live in one tile); ``BV = 64``
    halves the redundant ``Q Kᵀ`` and ``W``/``Q``/``K`` reloads of the four
    programs a head has at ``BV = 32``. Stages: as many as fit (≤ 3), a stage
    holding one chunk's ``Q``, ``K``, ``W`` (``BT × BK``) and ``U`` (``BT × BV``).
    """
    BK = dot_tile(K, 256)
    BV = dot_tile(V, 64)
    per_stage = 64 * (3 * BK + BV) * elem_bytes
    stages = max(1, min(3, _SHARED_BUDGET // per_stage))
    num_warps = 4 if BK * BV <= 128 * 64 else 8
    return {"BK": BK, "BV": BV, "num_warps": num_warps, "num_stages": stages}


@launcher(uses_atomics=False, kernels=(_chunk_state_output_fwd_kernel,))
def chunk_state_output_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output of every chunk, walking each document's chunk states in order.

    Args:
        q, k: ``[T, H, K]`` (the q/k the WY stage used), head ``hv // group``
            serves value head ``hv``.
        W: ``[T, HV, K]``, U: ``[T, HV, V]`` from :func:`~gdn_core.ops.wy.wy_fwd`
            (``k``'s dtype).
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g``.
        scale: the output scale.
        index: the chunk table (only its document offsets are read).
        group: value heads per key head.
        initial_state: ``[N, HV, K, V]`` (read as fp32) or ``None`` (zeros).
        output_final_state: also return the state after each document.

    Returns:
        ``(o [T, HV, V]`` in ``q``'s dtype, ``final [N, HV, K, V]`` fp32 or
        ``None)``. A zero-length document's final state is its initial state.

    Raises:
        ValueError: mismatched shapes, or ``K``/``V`` not a multiple of 16 in
            ``[16, 256]``.
    """
    T, H, K = q.shape
    HV, V = U.shape[1], U.shape[2]
    N = index.num_docs
    if (
        tuple(k.shape) != (T, H, K)
        or tuple(W.shape) != (T, HV, K)
        or U.shape[0] != T
        or HV != H * group
        or tuple(G.shape) != (T, HV)
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, W {tuple(W.shape)}, "
            f"U {tuple(U.shape)}, G {tuple(G.shape)}, group {group}, "
            f"index tokens {index.total_tokens}"
        )
    for name, d in (("K", K), ("V", V)):
        if d % 16 != 0 or not 16 <= d <= 256:
            raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, "
                             f"got {tuple(initial_state.shape)}")
        initial_state = initial_state.to(torch.float32).contiguous()
    q, k, W, U = (x.contiguous() for x in (q, k, W, U))
    G = G.float().contiguous()
    dev = q.device
    o = torch.empty(T, HV, V, dtype=q.dtype, device=dev)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state \
        else None
    if N == 0 or HV == 0:
        return o, final
    if T == 0:
        if final is not None and initial_state is not None:
            final.copy_(initial_state)
        elif final is not None:
            final.zero_()
        return o, final
    cfg = state_output_config(K, V, q.element_size())
    grid = (triton.cdiv(V, cfg["BV"]), N, HV)
    _chunk_state_output_fwd_kernel[grid](
        q, k, W, U, G, initial_state, o, final, index.doc_offsets, float(scale), H, HV,
        GROUP=group, K=K, V=V, BT=index.chunk_size, BK=cfg["BK"], BV=cfg["BV"],
        USE_H0=initial_state is not None, STORE_FINAL=output_final_state,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, final
