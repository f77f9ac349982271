"""Backward stage (d)+(e): WY backward, dG assembly and the reverse cumsum.

Forward (per chunk, value head ``hv``, q/k head ``hv // group``)::

    A_ij = β_i (k_i·k_j) exp(G_i − G_j)   (i > j),   T = (I + A)^{-1}
    W = T diag(βΓ) K,   U = T diag(β) V

Given ``dW`` and ``dU`` (= ``dV'``)::

    dK̃ = Tᵀ dW,  dṼ = Tᵀ dU,  dT = dW (diag(βΓ)K)ᵀ + dU (diag(β)V)ᵀ
    dA = −Tᵀ dT Tᵀ  on the strict lower triangle
    dk  = βΓ ⊙ dK̃ + E K + Eᵀ K,      E_ij = dA_ij β_i exp(G_i − G_j)
    dv  = β ⊙ dṼ
    dβ  = Γ (k·dK̃) + v·dṼ + Σ_j dA_ij (k_i·k_j) exp(G_i − G_j)
    dG  = βΓ (k·dK̃) + rowsum(dA ⊙ A) − colsum(dA ⊙ A)

Both orientations of ``dT``/``dA`` are computed by their own products
(``dTᵀ = K̃ dWᵀ + Ṽ dUᵀ``, ``dAᵀ = −T dTᵀ T``) from operands loaded through
swapped strides: no ``tl.trans`` of a dot result (miscompiled by Triton 3.6 on
Hopper).

The kernel then adds the per-K-block dG partials of the dQ/dK stage (in a
fixed order), takes the reverse within-chunk cumulative sum (``dg_t =
Σ_{s ≥ t in chunk} dG_s``) and writes ``dg``/``dbeta`` in their dtypes. ``dk``
partials ``[T,HV,K]`` fp32 are updated in place (each element by one
program). No atomics. Pinned at ``num_warps=4``: fla's WY-backward kernel was
wrong at ``num_warps=4`` on Hopper/Triton 3.6, but this kernel (no transposed
dot results) was checked on the H200 with Triton 3.6.0 at num_warps 2, 4 and 8
(bf16 and fp32, K/V = 128/128 and 64/256): identical errors against the fp32
reference, and num_warps=2 was 6.7x slower (register spills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.dv_local import dot_precision
from gdn_core.ops.registry import launcher

__all__ = ["wy_bwd", "wy_bwd_config"]


@triton.jit
def _wy_bwd_kernel(
    k,
    v,
    beta,
    G,
    A_inv,
    dw,
    du,
    dk,
    dg_part,
    dv,
    dbeta,
    dg,
    chunk_start,
    chunk_len,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GROUP: tl.constexpr,
    NKG: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // GROUP
    dt = k.dtype.element_ty
    start = tl.load(chunk_start + i_c).to(tl.int64)
    L = tl.load(chunk_len + i_c)

    o_t = tl.arange(0, BT)
    m_t = o_t < L
    rows = start + o_t
    m_valid = m_t[:, None] & m_t[None, :]

    b_b = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.load(G + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_bg = b_b * tl.where(m_t, tl.exp(b_g), 0.0)

    # T[i, j] and T^T[i, j] = T[j, i], both straight from memory.
    p_a = A_inv + i_hv * BT
    b_T = tl.load(p_a + rows[:, None] * (HV * BT) + o_t[None, :], mask=m_valid, other=0.0)
    b_Tt = tl.load(p_a + rows[None, :] * (HV * BT) + o_t[:, None], mask=m_valid, other=0.0)
    b_T = b_T.to(dt)
    b_Tt = b_Tt.to(dt)

    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_dTt = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)

    # V side: dT += dU (βV)^T, dT^T += (βV) dU^T, dv = β T^T dU, dβ += v·(T^T dU).
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_vt = m_v[:, None] & m_t[None, :]
        off_tv = rows[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        off_vt = rows[None, :] * (HV * V) + i_hv * V + o_v[:, None]
        b_v = tl.load(v + off_tv, mask=m_tv, other=0.0)
        b_vt = tl.load(v + off_vt, mask=m_vt, other=0.0)
        b_du = tl.load(du + off_tv, mask=m_tv, other=0.0).to(dt)
        b_dut = tl.load(du + off_vt, mask=m_vt, other=0.0).to(dt)
        b_vb = (b_v.to(tl.float32) * b_b[:, None]).to(dt)
        b_vbt = (b_vt.to(tl.float32) * b_b[None, :]).to(dt)
        b_dT += tl.dot(b_du, b_vbt, input_precision=DOT_PREC)
        b_dTt += tl.dot(b_vb, b_dut, input_precision=DOT_PREC)
        b_dvb = tl.dot(b_Tt, b_du, input_precision=DOT_PREC)
        b_db += tl.sum(b_dvb * b_v.to(tl.float32), axis=1)
        tl.store(dv + off_tv, (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)

    # K side, pass 1: dT += dW (βΓK)^T, dT^T += (βΓK) dW^T, kk = K K^T.
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        m_kt = m_k[:, None] & m_t[None, :]
        b_k = tl.load(k + rows[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
        b_kt = tl.load(k + rows[None, :] * (H * K) + i_h * K + o_k[:, None], mask=m_kt, other=0.0)
        off_tk = rows[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        off_kt = rows[None, :] * (HV * K) + i_hv * K + o_k[:, None]
        b_dw = tl.load(dw + off_tk, mask=m_tk, other=0.0).to(dt)
        b_dwt = tl.load(dw + off_kt, mask=m_kt, other=0.0).to(dt)
        b_kb = (b_k.to(tl.float32) * b_bg[:, None]).to(dt)
        b_kbt = (b_kt.to(tl.float32) * b_bg[None, :]).to(dt)
        b_dT += tl.dot(b_dw, b_kbt, input_precision=DOT_PREC)
        b_dTt += tl.dot(b_kb, b_dwt, input_precision=DOT_PREC)
        b_kk += tl.dot(b_k, b_kt, input_precision=DOT_PREC)

    # dA = -T^T dT T^T, dA^T = -T dT^T T (strict lower / strict upper).
    b_x = tl.dot(b_dT.to(dt), b_Tt, input_precision=DOT_PREC)
    b_dA = -tl.dot(b_Tt, b_x.to(dt), input_precision=DOT_PREC)
    b_xt = tl.dot(b_dTt.to(dt), b_T, input_precision=DOT_PREC)
    b_dAt = -tl.dot(b_T, b_xt.to(dt), input_precision=DOT_PREC)
    m_low = (o_t[:, None] > o_t[None, :]) & m_valid
    m_up = (o_t[:, None] < o_t[None, :]) & m_valid
    e_low = tl.exp(tl.where(m_low, b_g[:, None] - b_g[None, :], float("-inf")))  # [i, j]
    e_up = tl.exp(tl.where(m_up, b_g[None, :] - b_g[:, None], float("-inf")))  # [j, i]
    b_dA = tl.where(m_low, b_dA, 0.0)
    b_dAt = tl.where(m_up, b_dAt, 0.0)
    b_dAB = b_dA * b_kk * e_low  # dA_ij * (k_i.k_j) exp(G_i - G_j)
    b_db += tl.sum(b_dAB, axis=1)
    b_M = b_dAB * b_b[:, None]  # dA ⊙ A
    b_dg = tl.sum(b_M, axis=1) - tl.sum(b_M, axis=0)
    b_E = (b_dA * e_low * b_b[:, None]).to(dt)
    b_Et = (b_dAt * e_up * b_b[None, :]).to(dt)

    # K side, pass 2: dk += βΓ T^T dW + E K + E^T K.
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + rows[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
        off_tk = rows[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        b_dw = tl.load(dw + off_tk, mask=m_tk, other=0.0).to(dt)
        b_dkb = tl.dot(b_Tt, b_dw, input_precision=DOT_PREC)
        b_kdk = tl.sum(b_dkb * b_k.to(tl.float32), axis=1)
        b_db += b_kdk * tl.where(m_t, tl.exp(b_g), 0.0)
        b_dg += b_kdk * b_bg
        b_dk = b_dkb * b_bg[:, None]
        b_dk += tl.dot(b_E, b_k, input_precision=DOT_PREC)
        b_dk += tl.dot(b_Et, b_k, input_precision=DOT_PREC)
        b_dk += tl.load(dk + off_tk, mask=m_tk, other=0.0)
        tl.store(dk + off_tk, b_dk, mask=m_tk)

    # dG partials of the dQ/dK stage, in a fixed order; then the reverse cumsum.
    for i in range(NKG):
        b_dg += tl.load(dg_part + (i * T + rows) * HV + i_hv, mask=m_t, other=0.0)
    b_dg = tl.where(m_t, b_dg, 0.0)
    m_rev = o_t[None, :] >= o_t[:, None]  # [t, s]: s >= t
    b_dgc = tl.sum(tl.where(m_rev, b_dg[None, :], 0.0), axis=1)
    tl.store(dg + rows * HV + i_hv, b_dgc.to(dg.dtype.element_ty), mask=m_t)
    tl.store(dbeta + rows * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=m_t)


def wy_bwd_config(K: int, V: int) -> dict:
    """Pinned launch configuration (``num_warps``: see the module docstring)."""
    return {
        "BK": min(64, triton.next_power_of_2(K)),
        "BV": min(64, triton.next_power_of_2(V)),
        "num_warps": 4,
        "num_stages": 1,
    }


@launcher(uses_atomics=False, kernels=(_wy_bwd_kernel,))
def wy_bwd(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    A_inv: torch.Tensor,
    dw: torch.Tensor,
    du: torch.Tensor,
    dk: torch.Tensor,
    dg_part: torch.Tensor,
    index: ChunkIndex,
    group: int,
    g_dtype: torch.dtype,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """WY backward + dG assembly.

    ``k: [T,H,K]``; ``v, du: [T,HV,V]``; ``beta: [T,HV]``; ``G: [T,HV]`` fp32;
    ``A_inv: [T,HV,C]``; ``dw: [T,HV,K]``; ``dk: [T,HV,K]`` fp32 partials, updated
    in place; ``dg_part: [NK,T,HV]`` fp32 (the dQ/dK stage's dG partials).

    Returns ``(dk, dv [T,HV,V] in v's dtype, dbeta [T,HV] in beta's dtype,
    dg [T,HV] in g_dtype)``.
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dev = k.device
    if dv is None:
        dv = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    dbeta = torch.empty(T, HV, dtype=beta.dtype, device=dev)
    dg = torch.empty(T, HV, dtype=g_dtype, device=dev)
    NT = index.num_chunks
    if NT == 0:
        return dk, dv, dbeta, dg
    cfg = wy_bwd_config(K, V)
    _wy_bwd_kernel[(NT, HV)](
        k, v, beta, G, A_inv, dw, du, dk, dg_part, dv, dbeta, dg,
        index.chunk_start, index.chunk_len, T,
        H=H, HV=HV, K=K, V=V, GROUP=group, NKG=dg_part.shape[0], BT=index.chunk_size,
        BK=cfg["BK"], BV=cfg["BV"], DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dk, dv, dbeta, dg
