"""Backward stage (c): dQ, dK, dW and the chunk-local dG.

Per chunk and value head ``hv`` (q/k head ``hv // group``), with ``S = S_c``
(``h``), ``dS = dS_{c+1}`` (``dh``), ``V' = v_new``, ``dV'`` from the state
recurrence, ``D_ij = exp(G_i − G_j) [i ≥ j]`` and ``dP = dO V'ᵀ``::

    dQ  = scale (diag(Γ) dO Sᵀ + (dP ⊙ D) K)
    dK  = scale (dP ⊙ D)ᵀ Q + diag(exp(G_last − G)) V' dSᵀ
    dW  = −dV' Sᵀ
    dG_i = q_i·dQ_i − k_i·dK_i
           + [i = last] (exp(G_last) ⟨S, dS⟩ + Σ_j k_j·(exp(G_last − G_j) V'_j dSᵀ))

(the dG identity: the output's Γ and intra-chunk decay give ``rowsum − colsum``
of ``dP ⊙ P``, which equal ``q·dQ`` and the intra part of ``k·dK``; the state
update gives ``−k·dK_state`` and, at the chunk's last token, their sum plus the
``exp(G_last) S`` term.)

``(dP ⊙ D)ᵀ`` is computed as its own product ``V' dOᵀ`` from operands loaded
through swapped strides, never as ``tl.trans`` of a dot result (Triton 3.6
miscompiles that on Hopper).

One program per (K block, chunk, value head). ``dq``/``dk`` are per value head
partials ``[T, HV, K]`` fp32 (summed over the group later, in a fixed order);
``dg`` partials ``[NK, T, HV]`` fp32 (summed by the WY-backward kernel in a fixed
order); ``dw [T, HV, K]`` in the input dtype. No atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.dv_local import dot_precision
from gdn_core.ops.registry import launcher

__all__ = ["dqkwg_bwd", "dqkwg_config"]


@triton.jit
def _dqkwg_kernel(
    q,
    k,
    v_new,
    h,
    G,
    do,
    dh,
    dv,
    dq,
    dk,
    dw,
    dg,
    chunk_start,
    chunk_len,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GROUP: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // GROUP
    dt = k.dtype.element_ty
    start = tl.load(chunk_start + i_c).to(tl.int64)
    L = tl.load(chunk_len + i_c)

    o_t = tl.arange(0, BT)
    m_t = o_t < L
    rows = start + o_t
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    off_state = (i_c.to(tl.int64) * HV + i_hv) * (K * V)

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dp = tl.zeros([BT, BT], dtype=tl.float32)  # [i, j] = dO_i . V'_j
    b_dpt = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = V'_j . dO_i
    b_sds = tl.zeros([BK], dtype=tl.float32)  # per-row partial of <S, dS>
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_vt = m_v[:, None] & m_t[None, :]
        m_vk = m_v[:, None] & m_k[None, :]
        off_tv = rows[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        off_vt = rows[None, :] * (HV * V) + i_hv * V + o_v[:, None]
        off_vk = o_k[None, :] * V + o_v[:, None]  # element (v, k) of a [K, V] state
        b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0)
        b_vnt = tl.load(v_new + off_vt, mask=m_vt, other=0.0)
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        b_dot = tl.load(do + off_vt, mask=m_vt, other=0.0)
        b_dv = tl.load(dv + off_tv, mask=m_tv, other=0.0)
        b_ht = tl.load(h + off_state + off_vk, mask=m_vk, other=0.0)  # S^T  [BV, BK]
        b_dht = tl.load(dh + off_state + off_vk, mask=m_vk, other=0.0)  # dS^T [BV, BK]
        b_dp += tl.dot(b_do, b_vnt.to(dt), input_precision=DOT_PREC)
        b_dpt += tl.dot(b_vn.to(dt), b_dot, input_precision=DOT_PREC)
        b_dq += tl.dot(b_do, b_ht.to(dt), input_precision=DOT_PREC)
        b_dk += tl.dot(b_vn.to(dt), b_dht.to(dt), input_precision=DOT_PREC)
        b_dw += tl.dot(b_dv.to(dt), b_ht.to(dt), input_precision=DOT_PREC)
        b_sds += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)

    b_g = tl.load(G + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    g_last = tl.load(G + (start + L - 1) * HV + i_hv).to(tl.float32)
    m_tk = m_t[:, None] & m_k[None, :]
    off_qk = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_q = tl.load(q + off_qk, mask=m_tk, other=0.0)
    b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)

    m_valid = m_t[:, None] & m_t[None, :]
    m_low = (o_t[:, None] >= o_t[None, :]) & m_valid  # [i, j], i >= j
    m_up = (o_t[:, None] <= o_t[None, :]) & m_valid  # [j, i], i >= j
    b_ds = b_dp * tl.exp(tl.where(m_low, b_g[:, None] - b_g[None, :], float("-inf"))) * scale
    b_dst = b_dpt * tl.exp(tl.where(m_up, b_g[None, :] - b_g[:, None], float("-inf"))) * scale

    b_dq = b_dq * (tl.exp(b_g) * scale)[:, None]
    b_dq += tl.dot(b_ds.to(dt), b_k, input_precision=DOT_PREC)
    kd = tl.where(m_t, tl.exp(g_last - b_g), 0.0)
    b_dk_state = b_dk * kd[:, None]
    b_dk = b_dk_state + tl.dot(b_dst.to(dt), b_q, input_precision=DOT_PREC)

    b_qf = b_q.to(tl.float32)
    b_kf = b_k.to(tl.float32)
    b_dg = tl.sum(b_qf * b_dq, axis=1) - tl.sum(b_kf * b_dk, axis=1)
    last_term = tl.exp(g_last) * tl.sum(b_sds, axis=0) + tl.sum(tl.sum(b_kf * b_dk_state, axis=1))
    b_dg += tl.where(o_t == L - 1, last_term, 0.0)

    off_hk = rows[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    tl.store(dq + off_hk, b_dq, mask=m_tk)
    tl.store(dk + off_hk, b_dk, mask=m_tk)
    tl.store(dw + off_hk, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)
    tl.store(dg + (i_k * T + rows) * HV + i_hv, b_dg, mask=m_t)


def dqkwg_config(K: int, V: int) -> dict:
    """Pinned launch configuration (``BK`` also fixes the number of dg partials)."""
    return {
        "BK": min(64, triton.next_power_of_2(K)),
        "BV": min(64, triton.next_power_of_2(V)),
        "num_warps": 4,
        "num_stages": 1,
    }


def dqkwg_num_k_blocks(K: int) -> int:
    """How many K blocks (and so dg partials) :func:`dqkwg_bwd` produces."""
    return triton.cdiv(K, dqkwg_config(K, 16)["BK"])


@launcher(uses_atomics=False, kernels=(_dqkwg_kernel,))
def dqkwg_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    G: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dw: torch.Tensor | None = None,
    dg: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq [T,HV,K] fp32, dk [T,HV,K] fp32, dw [T,HV,K] input dtype,
    dg [NK,T,HV] fp32)``; the optional arguments supply the result buffers."""
    T, H, K = k.shape
    HV, V = do.shape[1], do.shape[2]
    cfg = dqkwg_config(K, V)
    NK = triton.cdiv(K, cfg["BK"])
    dev = k.device
    if dq is None:
        dq = torch.empty(T, HV, K, dtype=torch.float32, device=dev)
    if dk is None:
        dk = torch.empty(T, HV, K, dtype=torch.float32, device=dev)
    if dw is None:
        dw = torch.empty(T, HV, K, dtype=k.dtype, device=dev)
    if dg is None:
        dg = torch.empty(NK, T, HV, dtype=torch.float32, device=dev)
    NT = index.num_chunks
    if NT == 0:
        return dq, dk, dw, dg
    _dqkwg_kernel[(NK, NT, HV)](
        q, k, v_new, h, G, do, dh, dv, dq, dk, dw, dg,
        index.chunk_start, index.chunk_len, float(scale), T,
        H=H, HV=HV, K=K, V=V, GROUP=group, BT=index.chunk_size,
        BK=cfg["BK"], BV=cfg["BV"], DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dq, dk, dw, dg
