"""Backward stage (c): every chunk-local gradient — dQ, dK, dv, dβ, dg — in two kernels.

Given the state backward's results (``dS`` per chunk, the full ``dV'``), per (chunk,
value head ``hv``, q/k head ``hv // group``), with ``S = S_c`` (``h``), ``dS = dS_{c+1}``
(``dh``), ``V' = v_new``, ``dU = dV'``, ``D_ij = exp(G_i − G_j) [i ≥ j]``,
``dP = dO V'ᵀ``, ``T = (I + A)^{-1}`` (the forward's inverse), ``e_ij = exp(G_i − G_j)``::

    dQ  = scale diag(Γ) dO Sᵀ + scale (dP ⊙ D) K
    dW  = −dU Sᵀ,    dT = dW (diag(βΓ)K)ᵀ + dU (diag(β)V)ᵀ,    dṼ = Tᵀ dU
    dv  = β ⊙ dṼ,    E' = (−Tᵀ dT Tᵀ) ⊙ e   (strict lower triangle)
    C   = Γ ⊙ (Tᵀ dW) + E' K
    dK  = diag(exp(G_last − G)) V' dSᵀ + scale (dP ⊙ D)ᵀ Q + β ⊙ C + E'ᵀ (diag(β) K)
    dβ  = v·dṼ + k·C
    dg_t = Σ_{i ≥ t} q_i·dQ_state_i + exp(G_last)⟨S, dS⟩ + Σ_{j < t} k_j·dK_state_j
           + Σ_{i ≥ t} Σ_{j < t} (Mo + Mw)_ij + Σ_{i ≥ t} β_i Γ_i k_i·(Tᵀ dW)_i,
    Mo = scale (dP ⊙ D) ⊙ Q Kᵀ,    Mw = E' ⊙ diag(β) K Kᵀ

(``dg`` is the within-chunk reverse cumsum of ``dL/dG``, written so that only the
terms that survive enter: pairs crossing ``t``, the state terms of the tokens before
``t``. Summed as ``revcumsum(dL/dG)`` the O(1) pairs with both tokens ``≥ t`` would
cancel and leave ``ε·O(1)`` on tokens whose ``dg`` is tiny under strong decay;
docs/math.md.)

Two kernels, one program per (chunk, value head) each, every ``[64, ·]`` operand one
64-column block:

1. :func:`_dq_dv_kernel` — a sweep over V for ``dP`` and the ``dU`` half of ``dT``
   (``dṼ`` per block gives ``dv``, stored, and ``v·dṼ``); per K block a sweep over V
   for ``dO Sᵀ`` and ``dW``: ``dQ`` is finished and stored, ``dW`` enters ``dT``. It
   hands over ``dT`` (``[64, 64]`` in the input dtype, the precision its products read
   it in; written into the program's own rows of the ``dk`` output when ``K ≥ 64``, which
   the second kernel overwrites last, else into a scratch slot) and the fp32 ``[T, HV]``
   partials ``Σ_{i≥t} q_i·dQ_state_i`` and ``v·dṼ``.
2. :func:`_dk_kernel` — ``E'`` from ``dT`` (two 64³ products), ``K Kᵀ`` and ``K Qᵀ``,
   ``dPᵀ`` again (its own product ``V' dOᵀ``) and the pair terms of ``dg``; per K block
   a sweep over V for ``V' dSᵀ``, ``⟨S, dS⟩`` and ``dW`` again (from L2): ``dK`` is
   finished in one accumulator and stored; ``dg`` and ``dβ`` are completed.

What the pair of dQ/dK and WY-backward kernels before them wrote to HBM — ``dW``, an
fp32 ``dK`` partial, per-K-block ``dg`` partials — is gone (8–9% less peak memory of a
forward+backward); the time is the same (1.53 ms at B1 T32768 H16 in 8 documents, bf16,
H200). One kernel doing all of it took 2.24 ms: 255 registers, one CTA an SM
(``benchmarks/results/2026-12-01-h200-s10-chunk-grads-fused.md``).

Triton 3.6 on Hopper miscompiles ``tl.trans`` of a ``tl.dot`` result fed to another
dot, so transposed operands are loaded tiles (``tl.trans`` of a load is a view of
shared memory) or come back through memory: ``E'`` is written where ``dT`` was and
``E'ᵀ`` read through swapped strides after a CTA barrier. No other program reads or
writes those rows (rows past a short chunk's length are never touched).

``dq``/``dk``: per value head partials ``[T, HV, K]`` fp32 (summed over each group in
a fixed order later), or with one value head per q/k head the final values in any
float dtype (rounded once here). No atomics; the pinned configuration fixes every
sum's order, so the bits repeat run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.dv_local import dot_precision
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile, unit_last

__all__ = ["chunk_grads_bwd", "chunk_grads_config", "grad_outputs"]


@triton.jit
def crossing_sums(M, o_t):
    """``c_t = Σ_{i ≥ t} Σ_{j < t} M_ij`` of a ``[BT, BT]`` tile (``o_t = arange(BT)``).

    Only pairs crossing ``t`` enter: an inclusive scan along rows gives ``N_it =
    Σ_{j ≤ t} M_ij``, a masked column sum ``c_{t+1} = Σ_{i > t} N_it``, then a shift
    by one token (an exclusive scan formed as inclusive minus self would add
    ``ε |M_tt|``). Scans along rows stay within a warp's lanes."""
    N = tl.cumsum(M, axis=1)
    c = tl.sum(tl.where(o_t[:, None] > o_t[None, :], N, 0.0), axis=0)
    return tl.sum(tl.where(o_t[None, :] == o_t[:, None] - 1, c[None, :], 0.0), axis=1)


@triton.jit
def crossing_sums_t(Mt, o_t):
    """:func:`crossing_sums` of ``M`` given ``Mt = Mᵀ``: an inclusive reverse scan
    along rows (``R_jt = Σ_{i ≥ t} M_ij``), then a masked column sum."""
    R = tl.cumsum(Mt, axis=1, reverse=True)  # [j, t] = Σ_{i ≥ t} M_ij
    return tl.sum(tl.where(o_t[:, None] < o_t[None, :], R, 0.0), axis=0)


@triton.jit
def _chunk_gate(G, beta, A_inv, start, L, i_hv, HV: tl.constexpr, BT: tl.constexpr, dt):
    """What both kernels read of their chunk first: token offsets and masks, the gate
    cumsum ``G``, ``β``, ``Γ = exp(G)`` (fp32 ``[BT]``, zero past ``L``) and ``Tᵀ`` (the
    inverse loaded row-major with a row mask, so the loads vectorise, and transposed as a
    loaded operand, in ``dt``)."""
    G += start * HV + i_hv
    beta += start * HV + i_hv
    A_inv += start * (HV * BT) + i_hv * BT
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    m_valid = m_t[:, None] & m_t[None, :]
    b_g = tl.load(G + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_gam = tl.where(m_t, tl.exp(b_g), 0.0)
    b_T = tl.load(A_inv + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
    b_Tt = tl.trans(tl.where(m_valid, b_T, 0.0).to(dt))
    return o_t, m_t, m_valid, b_g, b_b, b_gam, b_Tt


@triton.jit
def _t_place(dk, dT, i_c, i_hv, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
             T_IN_DK: tl.constexpr):
    """``(pointer, row stride)`` of where this program keeps ``dT`` and then ``E'``: its own
    rows of ``dk`` (already offset to them) or its ``[BT, BT]`` slot of the scratch ``dT``.
    Accesses are row-masked by the chunk's length either way (rows past it hold zeros, and
    in ``dk`` they belong to the next chunk's program)."""
    if T_IN_DK:
        p = dk
        rs = HV * K
    else:
        p = dT + (i_c.to(tl.int64) * HV + i_hv) * (BT * BT)
        rs = BT
    return p, rs


@triton.jit
def _dq_dv_kernel(
    q, k, v, v_new, h, do, du, G, beta, A_inv, dq, dk, dv, dT, dg_part, db_part,
    chunk_start, chunk_len, scale, v_row, v_head,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    T_IN_DK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Phases A and B: ``dv``, ``dQ`` (stored), ``dT`` (stored in the input dtype, the
    precision its products read it in), ``Σ_{i≥t} q_i·dQ_state_i`` and ``v·dṼ``
    (fp32 partials of ``dg`` and ``dβ``). ``v`` is read at its own token and head
    strides ``v_row``, ``v_head`` (a view of a packed projection, unit last stride)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // GROUP
    dt = k.dtype.element_ty
    start = tl.load(chunk_start + i_c).to(tl.int64)
    L = tl.load(chunk_len + i_c)
    q += start * (H * K) + i_h * K
    k += start * (H * K) + i_h * K
    tv = start * (HV * V) + i_hv * V
    v += start * v_row + i_hv * v_head
    v_new += tv
    do += tv
    du += tv
    dv += tv
    h += (i_c.to(tl.int64) * HV + i_hv) * (K * V)
    dq += start * (HV * K) + i_hv * K
    dk += start * (HV * K) + i_hv * K
    p_t, rs_t = _t_place(dk, dT, i_c, i_hv, HV, K, BT, T_IN_DK)
    o_t, m_t, m_valid, b_g, b_b, b_gam, b_Tt = _chunk_gate(G, beta, A_inv, start, L, i_hv,
                                                           HV, BT, dt)

    # ---- A: dP, dT's dU half; dv and v·dṼ ----
    b_dp = tl.zeros([BT, BT], dtype=tl.float32)  # [i, j] = dO_i . V'_j
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        off_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0).to(dt)
        b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0).to(dt)
        b_du = tl.load(du + off_tv, mask=m_tv, other=0.0).to(dt)
        b_v = tl.load(v + o_t[:, None] * v_row + o_v[None, :], mask=m_tv,
                      other=0.0).to(tl.float32)
        b_dp = tl.dot(b_do, tl.trans(b_vn), b_dp, input_precision=DOT_PREC)
        b_dT = tl.dot(b_du, tl.trans((b_v * b_b[:, None]).to(dt)), b_dT,
                      input_precision=DOT_PREC)
        b_dvt = tl.dot(b_Tt, b_du, input_precision=DOT_PREC)
        b_db += tl.sum(b_dvt * b_v, axis=1)
        tl.store(dv + off_tv, (b_dvt * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
    m_low = (o_t[:, None] >= o_t[None, :]) & m_valid  # [i, j], i >= j
    b_ds = (b_dp * tl.exp(tl.where(m_low, b_g[:, None] - b_g[None, :], float("-inf")))
            * scale).to(dt)

    # ---- B: dQ (stored), dW into dT ----
    b_dgq = tl.zeros([BT], dtype=tl.float32)  # q·dQ_state, summed over K blocks
    b_bg = b_b * b_gam
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        off_vk = o_k[None, :] * V  # + o_v[:, None]: S^T block [BV, BK]
        b_dqs = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)  # dU S^T (= -dW)
        for i_v in range(0, V, BV):
            o_v = i_v + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            off_tv = o_t[:, None] * (HV * V) + o_v[None, :]
            b_do = tl.load(do + off_tv, mask=m_tv, other=0.0).to(dt)
            b_du = tl.load(du + off_tv, mask=m_tv, other=0.0).to(dt)
            b_ht = tl.load(h + off_vk + o_v[:, None], mask=m_v[:, None] & m_k[None, :],
                           other=0.0).to(dt)
            b_dqs = tl.dot(b_do, b_ht, b_dqs, input_precision=DOT_PREC)
            b_dw = tl.dot(b_du, b_ht, b_dw, input_precision=DOT_PREC)
        off_qk = o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)
        b_q = tl.load(q + off_qk, mask=m_tk, other=0.0)
        b_dqs = b_dqs * (b_gam * scale)[:, None]
        b_dgq += tl.sum(b_q.to(tl.float32) * b_dqs, axis=1)
        b_dq = tl.dot(b_ds, b_k, b_dqs, input_precision=DOT_PREC)
        tl.store(dq + o_t[:, None] * (HV * K) + o_k[None, :], b_dq.to(dq.dtype.element_ty),
                 mask=m_tk)
        b_dT = tl.dot((-b_dw).to(dt), tl.trans((b_k.to(tl.float32) * b_bg[:, None]).to(dt)),
                      b_dT, input_precision=DOT_PREC)
    tl.store(p_t + o_t[:, None] * rs_t + o_t[None, :], b_dT.to(dt).to(p_t.dtype.element_ty),
             mask=m_t[:, None])
    p_s = (start + o_t) * HV + i_hv
    tl.store(dg_part + p_s, tl.cumsum(b_dgq, axis=0, reverse=True), mask=m_t)
    tl.store(db_part + p_s, b_db, mask=m_t)


@triton.jit
def _dk_kernel(
    q, k, v_new, h, dh, do, du, G, beta, A_inv, dT, dg_part, db_part, dk, dbeta, dg,
    chunk_start, chunk_len, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    T_IN_DK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Phases C and D: ``E'`` from ``dT`` (whose slot then carries ``E'ᵀ``), ``dK``
    (stored), and ``dg``/``dβ`` completed from the first kernel's partials."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // GROUP
    dt = k.dtype.element_ty
    start = tl.load(chunk_start + i_c).to(tl.int64)
    L = tl.load(chunk_len + i_c)
    q += start * (H * K) + i_h * K
    k += start * (H * K) + i_h * K
    tv = start * (HV * V) + i_hv * V
    v_new += tv
    do += tv
    du += tv
    st = (i_c.to(tl.int64) * HV + i_hv) * (K * V)
    h += st
    dh += st
    dk += start * (HV * K) + i_hv * K
    p_t, rs_t = _t_place(dk, dT, i_c, i_hv, HV, K, BT, T_IN_DK)
    o_t, m_t, m_valid, b_g, b_b, b_gam, b_Tt = _chunk_gate(G, beta, A_inv, start, L, i_hv,
                                                           HV, BT, dt)
    g_last = tl.load(G + (start + L - 1) * HV + i_hv).to(tl.float32)

    # ---- C: E' = (-T^T dT T^T) ⊙ e on the strict lower triangle; K Kᵀ, K Qᵀ ----
    m_low1 = (o_t[:, None] > o_t[None, :]) & m_valid
    b_dT = tl.load(p_t + o_t[:, None] * rs_t + o_t[None, :], mask=m_t[:, None], other=0.0)
    b_x = tl.dot(b_dT.to(dt), b_Tt, input_precision=DOT_PREC)
    b_dA = tl.dot(b_Tt, b_x.to(dt), input_precision=DOT_PREC)
    b_E = tl.where(m_low1, -b_dA * tl.exp(tl.where(m_low1, b_g[:, None] - b_g[None, :], 0.0)),
                   0.0)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_kq = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = k_j . q_i
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        off_qk = o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)
        b_kk = tl.dot(b_k, tl.trans(b_k), b_kk, input_precision=DOT_PREC)
        b_kq = tl.dot(b_k, tl.trans(tl.load(q + off_qk, mask=m_tk, other=0.0)), b_kq,
                      input_precision=DOT_PREC)
    b_dg = crossing_sums(b_E * b_b[:, None] * b_kk, o_t)  # Mw's pairs
    b_E = b_E.to(dt)
    # E'^T through dT's place (spent): stored, a CTA barrier, read through swapped strides.
    tl.debug_barrier()  # every lane has read dT
    tl.store(p_t + o_t[:, None] * rs_t + o_t[None, :], b_E.to(p_t.dtype.element_ty),
             mask=m_t[:, None])
    tl.debug_barrier()
    b_Et = tl.load(p_t + o_t[None, :] * rs_t + o_t[:, None], mask=m_t[None, :],
                   other=0.0).to(dt)
    if T_IN_DK:
        tl.debug_barrier()  # every lane has read E' before phase D writes dk over it

    # dPᵀ = V' dOᵀ, masked: Mo's pairs (from Moᵀ = (dP ⊙ D)ᵀ scale ⊙ K Qᵀ) and dK's
    # intra-chunk operand.
    b_dpt = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = V'_j . dO_i
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        off_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0).to(dt)
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0).to(dt)
        b_dpt = tl.dot(b_vn, tl.trans(b_do), b_dpt, input_precision=DOT_PREC)
    m_up = (o_t[:, None] <= o_t[None, :]) & m_valid  # [j, i], i >= j
    b_dst = b_dpt * tl.exp(tl.where(m_up, b_g[None, :] - b_g[:, None], float("-inf"))) * scale
    b_dg += crossing_sums_t(b_dst * b_kq, o_t)
    b_dst16 = b_dst.to(dt)

    # ---- D: dK = kd ⊙ V' dS^T + (dP ⊙ D)^T scale Q + β ⊙ C + E'^T (βK) ----
    kd = tl.where(m_t, tl.exp(g_last - b_g), 0.0)
    b_kds = tl.zeros([BT], dtype=tl.float32)  # k·dK_state
    b_wr = tl.zeros([BT], dtype=tl.float32)  # k·Γ(T^T dW)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_sds = tl.zeros([BK], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        off_vk = o_k[None, :] * V
        b_dks = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)  # dU S^T (= -dW)
        for i_v in range(0, V, BV):
            o_v = i_v + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_vk = m_v[:, None] & m_k[None, :]
            off_tv = o_t[:, None] * (HV * V) + o_v[None, :]
            b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0).to(dt)
            b_du = tl.load(du + off_tv, mask=m_tv, other=0.0).to(dt)
            b_dht = tl.load(dh + off_vk + o_v[:, None], mask=m_vk, other=0.0,
                            eviction_policy="evict_first")
            b_ht = tl.load(h + off_vk + o_v[:, None], mask=m_vk, other=0.0)
            b_dks = tl.dot(b_vn, b_dht.to(dt), b_dks, input_precision=DOT_PREC)
            b_dw = tl.dot(b_du, b_ht.to(dt), b_dw, input_precision=DOT_PREC)
            b_sds += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
        off_qk = o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)
        b_q = tl.load(q + off_qk, mask=m_tk, other=0.0)
        b_kf = b_k.to(tl.float32)
        b_dks = b_dks * kd[:, None]
        b_kds += tl.sum(b_kf * b_dks, axis=1)
        b_acc = tl.dot(b_Tt, (-b_dw).to(dt), input_precision=DOT_PREC) * b_gam[:, None]
        b_wr += tl.sum(b_acc * b_kf, axis=1)
        b_acc = tl.dot(b_E, b_k, b_acc, input_precision=DOT_PREC)  # C
        b_db += tl.sum(b_acc * b_kf, axis=1)
        b_acc = tl.dot(b_Et, (b_kf * b_b[:, None]).to(dt), b_acc * b_b[:, None],
                       input_precision=DOT_PREC)
        b_acc = tl.dot(b_dst16, b_q, b_acc + b_dks, input_precision=DOT_PREC)
        tl.store(dk + o_t[:, None] * (HV * K) + o_k[None, :], b_acc.to(dk.dtype.element_ty),
                 mask=m_tk)

    # dg: exp(G_last)⟨S, dS⟩ on every token, Σ_{j<t} k_j·dK_state_j (a masked sum, no
    # exclusive scan formed as inclusive minus self), the WY row term's reverse cumsum,
    # and the first kernel's reverse cumsum of q·dQ_state.
    b_dg += tl.exp(g_last) * tl.sum(b_sds, axis=0)
    b_dg += tl.sum(tl.where(o_t[:, None] < o_t[None, :], b_kds[:, None], 0.0), axis=0)
    b_dg += tl.cumsum(b_b * b_wr, axis=0, reverse=True)
    p_s = (start + o_t) * HV + i_hv
    b_dg += tl.load(dg_part + p_s, mask=m_t, other=0.0)
    b_db += tl.load(db_part + p_s, mask=m_t, other=0.0)
    tl.store(dg + p_s, b_dg.to(dg.dtype.element_ty), mask=m_t)
    tl.store(dbeta + p_s, b_db.to(dbeta.dtype.element_ty), mask=m_t)


_DK_KERNEL = cached_launch(_dk_kernel)
_DQ_DV_KERNEL = cached_launch(_dq_dv_kernel)


def chunk_grads_config(K: int, V: int) -> dict:
    """Pinned launch configuration of both kernels: 64-column blocks of K and V, 4 warps."""
    return {
        "BK": dot_tile(K, 64),
        "BV": dot_tile(V, 64),
        "num_warps": 4,
        "num_stages": 2,
        "maxnreg": None,
    }


def grad_outputs(
    T: int, HV: int, V: int, v: torch.Tensor, beta: torch.Tensor, g_dtype: torch.dtype,
    dv: torch.Tensor | None, dbeta: torch.Tensor | None, dg: torch.Tensor | None,
) -> list[torch.Tensor]:
    """The result buffers ``dv [T,HV,V]`` (v's dtype), ``dbeta [T,HV]`` (beta's) and ``dg
    [T,HV]`` (``g_dtype``) of a chunk-gradient launcher: the caller's (e.g. row slices of
    whole-call outputs) or fresh ones.

    Raises:
        ValueError: a given buffer of another shape or dtype, or not contiguous.
    """
    specs = (("dv", dv, (T, HV, V), v.dtype), ("dbeta", dbeta, (T, HV), beta.dtype),
             ("dg", dg, (T, HV), g_dtype))
    out = []
    for name, buf, shape, dtype in specs:
        if buf is None:
            buf = torch.empty(shape, dtype=dtype, device=v.device)
        elif tuple(buf.shape) != shape or buf.dtype != dtype or not buf.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {shape} {dtype} tensor, got "
                             f"{tuple(buf.shape)} {buf.dtype} (contiguous={buf.is_contiguous()})")
        out.append(buf)
    return out


@launcher(uses_atomics=False, kernels=(_dq_dv_kernel, _dk_kernel))
def chunk_grads_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    do: torch.Tensor,
    du: torch.Tensor,
    G: torch.Tensor,
    beta: torch.Tensor,
    A_inv: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    g_dtype: torch.dtype,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    dbeta: torch.Tensor | None = None,
    dg: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every chunk-local gradient after the state backward (two launches).

    ``q, k: [T,H,K]``; ``v, v_new, do, du (= dV'): [T,HV,V]``, all contiguous but ``v``
    (any token and head strides, unit last); ``h, dh: [NT,HV,K,V]``
    (the state entering each chunk, ``dS`` of the state leaving it); ``G, beta: [T,HV]``
    (``G`` fp32); ``A_inv: [T,HV,64]`` (the forward's inverse, fp32 or, for 16-bit
    inputs, :func:`~gdn_core.ops.wy.inverse_for_backward`'s 16-bit copy).
    ``dq``/``dk``: result buffers ``[T,HV,K]`` contiguous, fp32 per value head
    partials (the default) or, with ``group == 1``, the final gradients in any float
    dtype.

    Returns ``(dq, dk, dv [T,HV,V] in v's dtype, dbeta [T,HV] in beta's dtype,
    dg [T,HV] in g_dtype)``.

    Raises:
        ValueError: a ``dq``/``dk`` buffer of another shape or not contiguous.
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dev = k.device
    v = unit_last(v)
    bufs = []
    for name, buf in (("dq", dq), ("dk", dk)):
        if buf is None:
            buf = torch.empty(T, HV, K, dtype=torch.float32, device=dev)
        elif tuple(buf.shape) != (T, HV, K) or not buf.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {(T, HV, K)} tensor, got "
                             f"{tuple(buf.shape)} (contiguous={buf.is_contiguous()})")
        bufs.append(buf)
    dq, dk = bufs
    dv, dbeta, dg = grad_outputs(T, HV, V, v, beta, g_dtype, dv, dbeta, dg)
    NT = index.num_chunks
    if NT == 0 or HV == 0:
        return dq, dk, dv, dbeta, dg
    cfg = chunk_grads_config(K, V)
    C = index.chunk_size
    # dT leaves the first kernel in k's dtype (its products read it so) and its place
    # carries E'ᵀ in the second: the program's own rows of dk when they hold 64 columns
    # without rounding it further (no scratch), else a slot of a scratch buffer. The
    # fp32 partials of dg and dβ are [T, HV].
    t_in_dk = K >= C and dk.dtype in (k.dtype, torch.float32)
    dT = dk if t_in_dk else torch.empty(NT * HV * C * C, dtype=k.dtype, device=dev)
    dg_part = torch.empty(T, HV, dtype=torch.float32, device=dev)
    db_part = torch.empty(T, HV, dtype=torch.float32, device=dev)
    constexprs = dict(H=H, HV=HV, K=K, V=V, GROUP=group, BT=C, BK=cfg["BK"], BV=cfg["BV"],
                      T_IN_DK=t_in_dk, DOT_PREC=dot_precision(k.dtype),
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                      maxnreg=cfg["maxnreg"])
    _DQ_DV_KERNEL[(NT, HV)](
        q, k, v, v_new, h, do, du, G, beta, A_inv, dq, dk, dv, dT, dg_part, db_part,
        index.chunk_start, index.chunk_len, float(scale), v.stride(0), v.stride(1), **constexprs)
    _DK_KERNEL[(NT, HV)](
        q, k, v_new, h, dh, do, du, G, beta, A_inv, dT, dg_part, db_part, dk, dbeta, dg,
        index.chunk_start, index.chunk_len, float(scale), **constexprs)
    return dq, dk, dv, dbeta, dg
