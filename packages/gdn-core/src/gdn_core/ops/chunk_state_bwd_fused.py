"""Backward stages (a)+(b) in one kernel: the reverse state recurrence computing each
chunk's local ``dV'`` itself instead of reading it.

The recurrence of :mod:`gdn_core.ops.chunk_state_bwd`, per document, chunks in reverse,
from ``dS_N = dht`` (or 0), with stage (a) (:mod:`gdn_core.ops.dv_local`) folded in::

    dv_local_c = scale · (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j])ᵀ dO     (rounded to the input dtype)
    dV'_c      = dv_local_c + diag(exp(G_last − G)) (K_c dS_{c+1})
    dS_c       = exp(G_last) dS_{c+1} + Q_cᵀ (scale Γ dO_c) − W_cᵀ dV'_c
    dh0        = dS_0

The ``[T, HV, V]`` ``dv_local`` tensor is neither written nor read: each program
(V block, value head, document) rebuilds the chunk's ``[BT, BT]`` score matrix ``Pᵀ`` and
multiplies it by the ``dO`` block it loads for the recurrence anyway.

Bits: the same as ``chunk_state_bwd(dv_local_bwd(...))``. The local part repeats
``_dv_local_kernel``'s operations in its order: ``Pᵀ`` summed over K blocks of that
kernel's width (``dv_local_config``'s ``BK``, loaded again at that width unless it is the
whole K tile), the decay and ``scale`` applied in the same order, ``Pᵀ`` rounded to the
input dtype, the ``Pᵀ dO`` product rounded to the input dtype (what the two-kernel path
stores and re-reads) and widened again. Only the product's value block differs (the
recurrence's ``BV`` columns instead of ``dv_local``'s 64): every output element is still
one dot over the same ``BT`` terms of the same operands.

Cost: ``Pᵀ`` (``2·BT²·K`` FLOPs a chunk) is rebuilt by each of the ``V/BV`` value
blocks, instead of once per chunk and head; the ``Pᵀ dO`` product is not repeated (each
block does its own columns). In exchange ``dv_local`` is not written (stage (a)) nor read
(stage (b)).

Outputs as :func:`~gdn_core.ops.chunk_state_bwd.chunk_state_bwd`: ``dh [NT, HV, K, V]``
(input dtype), ``dv [T, HV, V]`` (the full ``dV'``, input dtype), ``dh0 [N, HV, K, V]``
fp32; ``store=False`` / ``need`` as there. No atomics; no reduction crosses programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.chunk_state_bwd import chunk_state_bwd_config
from gdn_core.ops.dv_local import dot_precision, dv_local_config
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["chunk_state_bwd_fused", "chunk_state_bwd_fused_config"]


@triton.jit
def _chunk_state_bwd_fused_kernel(
    q,
    k,
    W,
    G,
    do,
    dht,
    dh,
    dv,
    dh0,
    doc_offsets,
    doc_chunk_offsets,
    need,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GROUP: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BKL: tl.constexpr,
    USE_DHT: tl.constexpr,
    HAS_NEED: tl.constexpr,
    STORE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_n = tl.program_id(2)
    i_h = i_hv // GROUP
    if HAS_NEED:
        if tl.load(need + i_n) == 0:
            return
    dt = k.dtype.element_ty

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    off_state = (i_n.to(tl.int64) * HV + i_hv) * (K * V)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + off_state + off_kv, mask=m_kv, other=0.0).to(tl.float32)

    bos = tl.load(doc_offsets + i_n).to(tl.int64)
    eos = tl.load(doc_offsets + i_n + 1).to(tl.int64)
    c0 = tl.load(doc_chunk_offsets + i_n).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, BT)
    for it in range(0, n_chunks):
        ic = n_chunks - 1 - it
        t0 = bos + ic * BT
        L = tl.minimum(eos - t0, BT).to(tl.int32)
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        m_kt = m_k[:, None] & m_t[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        rows = t0 + o_t
        off_tv = rows[:, None] * (HV * V) + i_hv * V + o_v[None, :]

        # dh[c] = dS_{c+1}
        if STORE:
            tl.store(dh + ((c0 + ic) * HV + i_hv) * (K * V) + off_kv, b_dh.to(dh.dtype.element_ty),
                     mask=m_kv)

        b_k = tl.load(k + rows[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
        b_qt = tl.load(q + rows[None, :] * (H * K) + i_h * K + o_k[:, None], mask=m_kt, other=0.0)
        b_wt = tl.load(W + rows[None, :] * (HV * K) + i_hv * K + o_k[:, None], mask=m_kt, other=0.0)
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        p_g = G + t0 * HV + i_hv
        b_g = tl.load(p_g + o_t * HV, mask=m_t, other=0.0)
        g_last = tl.load(p_g + (L - 1) * HV)

        # dv_local, as _dv_local_kernel computes and stores it: P^T[j, i] = k_j . q_i summed
        # over K blocks of BKL (its BK), the decay mask, scale, rounded; P^T dO rounded.
        b_pt = tl.zeros([BT, BT], dtype=tl.float32)
        if BKL == BK:
            b_pt += tl.dot(b_k, b_qt, input_precision=DOT_PREC)
        else:
            for i_kl in tl.static_range((K + BKL - 1) // BKL):
                o_kl = i_kl * BKL + tl.arange(0, BKL)
                m_kl = o_kl < K
                b_kl = tl.load(k + rows[:, None] * (H * K) + i_h * K + o_kl[None, :],
                               mask=m_t[:, None] & m_kl[None, :], other=0.0)
                b_qtl = tl.load(q + rows[None, :] * (H * K) + i_h * K + o_kl[:, None],
                                mask=m_kl[:, None] & m_t[None, :], other=0.0)
                b_pt += tl.dot(b_kl, b_qtl, input_precision=DOT_PREC)
        # row j, column i: keep i >= j inside the chunk.
        m_pt = (o_t[None, :] >= o_t[:, None]) & m_t[None, :] & m_t[:, None]
        decay = tl.exp(tl.where(m_pt, b_g[None, :] - b_g[:, None], float("-inf")))
        b_pt = (b_pt * decay * scale).to(dt)
        b_dvl = tl.dot(b_pt, b_do, input_precision=DOT_PREC).to(dt)

        # dV' = dv_local + diag(exp(G_last - G)) (K dS_{c+1})
        kd = tl.where(m_t, tl.exp(g_last - b_g), 0.0)
        b_dv = tl.dot(b_k, b_dh.to(dt), input_precision=DOT_PREC) * kd[:, None]
        b_dv += b_dvl.to(tl.float32)
        if STORE:
            tl.store(dv + off_tv, b_dv.to(dv.dtype.element_ty), mask=m_tv)

        # dS_c = exp(G_last) dS_{c+1} + Q^T (scale Γ dO) - W^T dV'
        b_dos = (b_do.to(tl.float32) * (tl.exp(b_g) * scale)[:, None]).to(dt)
        b_dh = tl.dot(b_qt, b_dos, b_dh * tl.exp(g_last), input_precision=DOT_PREC)
        b_dh = tl.dot(b_wt.to(dt), (-b_dv).to(dt), b_dh, input_precision=DOT_PREC)

    tl.store(dh0 + off_state + off_kv, b_dh, mask=m_kv)


def chunk_state_bwd_fused_config(K: int, V: int, elem_bytes: int = 2) -> dict:
    """Pinned launch configuration: the recurrence's tiles, warps and stages
    (:func:`~gdn_core.ops.chunk_state_bwd.chunk_state_bwd_config`: whole K, ``BV`` columns,
    the tiles a chunk reads pipelined ``num_stages`` deep behind the serial ``dS`` chain),
    and ``BKL``, the K width ``Pᵀ`` is summed over (``dv_local_config``'s ``BK``: the
    two-kernel path's summation order, hence its bits).

    The K-block copies of ``q``/``k`` (when ``BKL < BK``) are more pipelined tiles:
    at bf16, K = V = 128 three stages need 268,296 B of shared memory (over the H200's
    227 KB), so 16-bit inputs with ``BKL < BK`` take two stages: 225 registers, no
    spills, 181,252 B (``tools/sm90_report.py fused_state_bwd``; the recurrence alone:
    151 registers, 177,160 B at three stages). At K = 256 (8 warps, ``BV = 64``) it spills
    248 B, so the backward routes only K <= 128 here
    (:func:`gdn_core.ops.backward.use_fused_state_bwd`).
    """
    cfg = dict(chunk_state_bwd_config(K, V, elem_bytes))
    cfg["BKL"] = dv_local_config(K, V)["BK"]
    if cfg["BKL"] < cfg["BK"] and cfg["num_stages"] > 2:
        cfg["num_stages"] = 2
    return cfg


_CHUNK_STATE_BWD_FUSED_KERNEL = cached_launch(_chunk_state_bwd_fused_kernel)


@launcher(uses_atomics=False, kernels=(_chunk_state_bwd_fused_kernel,))
def chunk_state_bwd_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    G: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    scale: float,
    index: ChunkIndex,
    group: int,
    dh: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    *,
    store: bool = True,
    need: torch.Tensor | None = None,
    dh0: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Reverse state recurrence with the local ``dV'`` computed inside. Returns
    ``(dh [NT,HV,K,V], dv [T,HV,V], dh0 [N,HV,K,V] fp32)``, the bits of
    ``chunk_state_bwd(q, k, W, G, do, dv_local_bwd(q, k, G, do, scale, index, group), ...)``.

    ``q, k: [T,H,K]``; ``W: [T,HV,K]``; ``G: [T,HV]`` fp32; ``do: [T,HV,V]``; all but
    ``G`` in one dtype (contiguous); ``dht: [N,HV,K,V]`` or ``None``. ``dh``/``dv`` may
    supply the result buffers (``dv`` must not alias an input). ``store=False``: only
    ``dh0`` (``dh``/``dv`` returned as ``None``). ``need``: optional int32 ``[N]``;
    documents with ``need == 0`` are skipped (their ``dh0`` rows left unwritten).
    ``dh0`` may supply that result's fp32 buffer, and may be ``dht`` itself.

    Raises:
        ValueError: ``need`` is not int32 ``[N]``, or ``dh0`` not a contiguous fp32
            ``[N, HV, K, V]``.
    """
    T, H, K = k.shape
    HV, V = do.shape[1], do.shape[2]
    N, NT = index.num_docs, index.num_chunks
    if need is not None and (need.dtype != torch.int32 or tuple(need.shape) != (N,)):
        raise ValueError(f"need must be int32 [N={N}], got {need.dtype} {tuple(need.shape)}")
    if not store:
        dh = dv = None
    else:
        if dh is None:
            dh = torch.empty(NT, HV, K, V, dtype=k.dtype, device=k.device)
        if dv is None:
            dv = torch.empty(T, HV, V, dtype=k.dtype, device=k.device)
    if dh0 is None:
        dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device)
    elif dh0.dtype != torch.float32 or tuple(dh0.shape) != (N, HV, K, V) or not dh0.is_contiguous():
        raise ValueError(f"dh0 must be a contiguous fp32 [N, HV, K, V] = {(N, HV, K, V)}, "
                         f"got {dh0.dtype} {tuple(dh0.shape)} "
                         f"(contiguous={dh0.is_contiguous()})")
    if N == 0:
        return dh, dv, dh0
    if dht is not None:
        dht = dht.contiguous()
    cfg = chunk_state_bwd_fused_config(K, V, k.element_size())
    grid = (triton.cdiv(V, cfg["BV"]), HV, N)
    _CHUNK_STATE_BWD_FUSED_KERNEL[grid](
        q, k, W, G, do, dht if dht is not None else dh0,
        dh if store else dh0, dv if store else dh0, dh0,
        index.doc_offsets, index.doc_chunk_offsets,
        need if need is not None else index.doc_chunk_offsets, float(scale),
        H=H, HV=HV, K=K, V=V, GROUP=group, BT=index.chunk_size,
        BK=cfg["BK"], BV=cfg["BV"], BKL=cfg["BKL"], USE_DHT=dht is not None,
        HAS_NEED=need is not None, STORE=store, DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dh, dv, dh0
