"""Backward stage (c): dQ, dK, dW and this stage's part of dg.

Per chunk and value head ``hv`` (q/k head ``hv // group``), with ``S = S_c``
(``h``), ``dS = dS_{c+1}`` (``dh``), ``V' = v_new``, ``dV'`` from the state
recurrence, ``D_ij = exp(G_i − G_j) [i ≥ j]`` and ``dP = dO V'ᵀ``::

    dQ   = dQ_state + dQ_intra = scale diag(Γ) dO Sᵀ + scale (dP ⊙ D) K
    dK   = dK_state + dK_intra = diag(exp(G_last − G)) V' dSᵀ + scale (dP ⊙ D)ᵀ Q
    dW   = −dV' Sᵀ
    dg_t = Σ_{i ≥ t} q_i·dQ_state_i + exp(G_last) ⟨S, dS⟩ + Σ_{j < t} k_j·dK_state_j
           + Σ_{i ≥ t} Σ_{j < t} Mo_ij  + (the WY part),    Mo = scale (dP ⊙ D) ⊙ Q Kᵀ

(``dg = revcumsum(dL/dG)`` within the chunk. ``dL/dG_i = q_i·dQ_i − k_i·dK_i +
[i = last](exp(G_last)⟨S, dS⟩ + Σ_j k_j·dK_state_j)``, where ``q·dQ_intra`` and
``k·dK_intra`` are the row and column sums of ``Mo``; summed that way, the O(1)
pairs with both tokens ``≥ t`` (the diagonal, the state term of the last token)
cancel and leave ``ε·O(1)`` on tokens whose ``dg`` is tiny under strong decay.
Written as above only the terms that survive enter: pairs crossing ``t``, the
state term of the tokens before ``t``. Each K block's partial is in this final
form; :mod:`gdn_core.ops.wy_bwd` adds them and the WY part, with no cumsum over
them. ``k·dK_state`` joins ``Mo``'s transposed tile as the last token's row, so
one reverse scan along rows and one masked column sum give both.)

``(dP ⊙ D)ᵀ`` is computed as its own product ``V' dOᵀ`` from operands loaded
through swapped strides, never as ``tl.trans`` of a dot result (Triton 3.6
miscompiles that on Hopper).

One program per (K block, chunk, value head), in two phases so that at most
three fp32 ``[BT, ·]`` accumulators are live at once (all five together spilled):

1. sweep V for ``dP``, ``dO Sᵀ`` and ``dV' Sᵀ``; store ``dW``, finish and store
   ``dQ``, keep the reverse cumsum of ``q·dQ_state`` for ``dg``;
2. sweep V again for ``dPᵀ``, ``V' dSᵀ`` and ``⟨S, dS⟩`` (``S`` re-read, from L2);
   finish and store ``dK``; ``Moᵀ`` from ``(dP ⊙ D)ᵀ`` and one more product
   ``K Qᵀ`` (this K block's part of ``q_i·k_j``); store ``dg``.

Each sweep's loads feed the dots directly, so with ``num_stages=2`` the software
pipeline copies them into shared memory asynchronously instead of staging them
in registers. Per-element offsets are 32-bit, added to 64-bit per-program base
pointers. ``dS`` is read once (``evict_first``); the fp32 partials are streamed
out (``.cs``).

``dq``/``dk`` are per value head partials ``[T, HV, K]`` fp32 (summed over the
group later, in a fixed order; with one value head per q/k head ``dq`` is final
and may be a buffer of q's dtype, rounded once here); ``dg`` partials
``[NK, T, HV]`` fp32, in final form (summed by the WY-backward kernel in a fixed
order); ``dw [T, HV, K]`` in the input dtype. No atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.dv_local import dot_precision
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile

__all__ = ["dqkwg_bwd", "dqkwg_config"]


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

    # 64-bit scalar bases, 32-bit per-element offsets.
    q += (start * H + i_h) * K + i_k * BK
    k += (start * H + i_h) * K + i_k * BK
    tv = start * (HV * V) + i_hv * V
    v_new += tv
    do += tv
    dv += tv
    st = (i_c.to(tl.int64) * HV + i_hv) * (K * V) + i_k * BK * V
    h += st
    dh += st
    hk = (start * HV + i_hv) * K + i_k * BK
    dq += hk
    dk += hk
    dw += hk
    G += start * HV + i_hv

    o_t = tl.arange(0, BT)
    m_t = o_t < L
    o_k = tl.arange(0, BK)
    m_k = o_k < K - i_k * BK
    m_tk = m_t[:, None] & m_k[None, :]
    off_qk = o_t[:, None] * (H * K) + o_k[None, :]
    off_hk = o_t[:, None] * (HV * K) + o_k[None, :]

    b_g = tl.load(G + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    g_last = tl.load(G + (L - 1) * HV).to(tl.float32)
    m_valid = m_t[:, None] & m_t[None, :]

    # Phase 1 (reads dO, V'^T, S^T, dV'): dP, dQ_state and dW.
    b_dp = tl.zeros([BT, BT], dtype=tl.float32)  # [i, j] = dO_i . V'_j
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        off_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        off_vt = o_t[None, :] * (HV * V) + o_v[:, None]
        off_vk = o_k[None, :] * V + o_v[:, None]
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        b_vnt = tl.load(v_new + off_vt, mask=m_v[:, None] & m_t[None, :], other=0.0)
        b_ht = tl.load(h + off_vk, mask=m_v[:, None] & m_k[None, :], other=0.0)
        b_dv = tl.load(dv + off_tv, mask=m_tv, other=0.0)
        b_dp = tl.dot(b_do, b_vnt.to(dt), b_dp, input_precision=DOT_PREC)
        b_dq = tl.dot(b_do, b_ht.to(dt), b_dq, input_precision=DOT_PREC)
        b_dw = tl.dot(b_dv.to(dt), b_ht.to(dt), b_dw, input_precision=DOT_PREC)
    tl.store(dw + off_hk, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)

    m_low = (o_t[:, None] >= o_t[None, :]) & m_valid  # [i, j], i >= j
    b_ds = b_dp * tl.exp(tl.where(m_low, b_g[:, None] - b_g[None, :], float("-inf"))) * scale
    b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)
    b_q = tl.load(q + off_qk, mask=m_tk, other=0.0)
    b_dq = b_dq * (tl.exp(b_g) * scale)[:, None]
    # dg: the reverse cumsum of q·dQ_state.
    b_dg = tl.cumsum(tl.sum(b_q.to(tl.float32) * b_dq, axis=1), axis=0, reverse=True)
    b_dq = tl.dot(b_ds.to(dt), b_k, b_dq, input_precision=DOT_PREC)
    tl.store(dq + off_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk, cache_modifier=".cs")

    # Phase 2 (reads V', dO^T, dS^T, S^T): dP^T, dK_state and <S, dS>.
    b_dpt = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = V'_j . dO_i
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_sds = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        m_vk = m_v[:, None] & m_k[None, :]
        off_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        off_vt = o_t[None, :] * (HV * V) + o_v[:, None]
        off_vk = o_k[None, :] * V + o_v[:, None]
        b_vn = tl.load(v_new + off_tv, mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_dot = tl.load(do + off_vt, mask=m_v[:, None] & m_t[None, :], other=0.0)
        b_dht = tl.load(dh + off_vk, mask=m_vk, other=0.0, eviction_policy="evict_first")
        b_ht = tl.load(h + off_vk, mask=m_vk, other=0.0)
        b_dpt = tl.dot(b_vn.to(dt), b_dot, b_dpt, input_precision=DOT_PREC)
        b_dk = tl.dot(b_vn.to(dt), b_dht.to(dt), b_dk, input_precision=DOT_PREC)
        b_sds += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)

    b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)
    kd = tl.where(m_t, tl.exp(g_last - b_g), 0.0)
    b_dk = b_dk * kd[:, None]
    # dg: exp(G_last)⟨S, dS⟩ on every token; k_j·dK_state_j joins the pair tile
    # below as the last token's row (so Σ_{j<t} of it enters each token).
    b_dg += tl.exp(g_last) * tl.sum(b_sds, axis=0)
    b_kds = tl.sum(b_k.to(tl.float32) * b_dk, axis=1)
    m_up = (o_t[:, None] <= o_t[None, :]) & m_valid  # [j, i], i >= j
    b_dst = b_dpt * tl.exp(tl.where(m_up, b_g[None, :] - b_g[:, None], float("-inf"))) * scale
    b_q = tl.load(q + off_qk, mask=m_tk, other=0.0)
    b_dk = tl.dot(b_dst.to(dt), b_q, b_dk, input_precision=DOT_PREC)
    tl.store(dk + off_hk, b_dk, mask=m_tk, cache_modifier=".cs")
    # dg: the pairs crossing each token of Mo = (dP ⊙ D) scale ⊙ Q Kᵀ (this K
    # block's part of q_i·k_j), from Moᵀ = (dP ⊙ D)ᵀ scale ⊙ K Qᵀ.
    b_kq = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)
    b_mt = b_dst * b_kq + tl.where(o_t[None, :] == L - 1, b_kds[:, None], 0.0)
    b_dg += crossing_sums_t(b_mt, o_t)
    tl.store(dg + (i_k * T + start + o_t) * HV + i_hv, b_dg, mask=m_t)


def dqkwg_config(K: int, V: int) -> dict:
    """Pinned launch configuration (``BK`` also fixes the number of dg partials)."""
    return {
        "BK": dot_tile(K, 64),
        "BV": dot_tile(V, 64),
        "num_warps": 4,
        "num_stages": 2,
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
    dg [NK,T,HV] fp32)``; the optional arguments supply the result buffers (``dq``
    may be of any float dtype: the kernel rounds into it)."""
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
