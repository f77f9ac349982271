"""Backward stage (b): the reverse chunk recurrence for the state gradient.

For each document, from ``dS_N = dht`` (or 0), over its chunks in reverse::

    dV'_c = dv_local_c + (K_c ⊙ exp(G_last − G))  dS_{c+1}
    dS_c  = exp(G_last) dS_{c+1} + scale (diag(Γ) Q_c)ᵀ dO_c − W_cᵀ dV'_c
    dh0   = dS_0

One program per (V block, value head, document) keeps its ``[K, BV]`` slice of
``dS`` in fp32 registers (the whole K extent: the ``Kd · dS`` term contracts
over K, so K cannot be split across programs). Transposed operands (``Qᵀ``,
``Wᵀ``) are loaded through swapped strides.

Latency, not arithmetic, bounds this loop (three dependent dots per chunk), so
everything a chunk reads is a function of the chunk's position alone: chunk
rows come from the document's offsets (no per-chunk table lookups whose loads
would head the chain), and every tile is a direct dot operand or is scaled on
the other side of the dot (``diag(kd) (K dS)`` rather than ``(diag(kd) K) dS``;
``Qᵀ (diag(scale Γ) dO)``), which lets the pipeliner (``num_stages=3``) keep
the next chunks' copies in flight while the current chunk runs.

Outputs:

* ``dh [NT, HV, K, V]`` — ``dh[c] = dS_{c+1}``, the gradient of the state
  *leaving* chunk ``c`` (= entering chunk ``c+1``), stored in the input dtype
  like the forward's ``h``;
* ``dv [T, HV, V]`` — the full ``dV'`` (= ``dU`` of the WY stage), input dtype;
* ``dh0 [N, HV, K, V]`` fp32.

With ``store=False`` only ``dh0`` is written (the segment path's first
pass, :mod:`gdn_core.segment`: each segment's initial-state gradient), and
``need`` (int32 per document, nonzero = wanted) lets the programs of
unwanted documents return at once.

No atomics; no reduction crosses programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.dv_local import dot_precision
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile

__all__ = ["chunk_state_bwd", "chunk_state_bwd_config"]


@triton.jit
def _chunk_state_bwd_kernel(
    q,
    k,
    W,
    G,
    do,
    dv_local,
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
        b_dvl = tl.load(dv_local + off_tv, mask=m_tv, other=0.0)
        b_qt = tl.load(q + rows[None, :] * (H * K) + i_h * K + o_k[:, None], mask=m_kt, other=0.0)
        b_wt = tl.load(W + rows[None, :] * (HV * K) + i_hv * K + o_k[:, None], mask=m_kt, other=0.0)
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        p_g = G + t0 * HV + i_hv
        b_g = tl.load(p_g + o_t * HV, mask=m_t, other=0.0)
        g_last = tl.load(p_g + (L - 1) * HV)

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


_CHUNK_STATE_BWD_KERNEL = cached_launch(_chunk_state_bwd_kernel)


def chunk_state_bwd_config(K: int, V: int, elem_bytes: int = 2) -> dict:
    """Pinned launch configuration: the whole K extent in one tile, ``BV`` columns.

    Every tile a chunk reads depends only on the chunk's position, so with
    ``num_stages=3`` the pipeliner keeps the next two chunks' copies in flight
    behind the serial ``dS`` chain. That fits in shared memory for 16-bit
    inputs (``elem_bytes=2``) up to ``BK = 128`` (fp32 at K=V=128 needs 241 KB
    of the H200's 227 KB); fp32 inputs and ``BK = 256`` take one stage. ``BK = 256``
    takes ``BV = 64`` on 8 warps: 32 columns there give wrong gradients on the H200
    (:mod:`gdn_core.ops.tiles`).
    """
    BK = dot_tile(K, 256)
    BV = dot_tile(V, 32 if BK <= 128 else 64)
    stages = 3 if BK <= 128 and elem_bytes <= 2 else 1
    return {"BK": BK, "BV": BV, "num_warps": 4 if BK <= 128 else 8, "num_stages": stages}


@launcher(uses_atomics=False, kernels=(_chunk_state_bwd_kernel,))
def chunk_state_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    G: torch.Tensor,
    do: torch.Tensor,
    dv_local: torch.Tensor,
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
    """Reverse state recurrence. Returns ``(dh [NT,HV,K,V], dv [T,HV,V], dh0 [N,HV,K,V] fp32)``.

    ``q, k: [T,H,K]``; ``W: [T,HV,K]``; ``G: [T,HV]`` fp32; ``do, dv_local: [T,HV,V]``;
    ``dht: [N,HV,K,V]`` or ``None``. ``dh``/``dv`` may supply the result buffers;
    ``dv`` may be ``dv_local`` itself (each element of ``dV'`` is stored by the
    program that loaded its ``dv_local``, after loading it).
    ``store=False``: only ``dh0`` (``dh``/``dv`` are returned as ``None``).
    ``need``: optional int32 ``[N]``; documents with ``need == 0`` are skipped
    (their ``dh0`` rows are left unwritten).
    ``dh0`` may supply that result's fp32 buffer, and may be ``dht`` itself (each
    program loads its ``dht`` tile first and stores the same ``dh0`` tile last).
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
    cfg = chunk_state_bwd_config(K, V, k.element_size())
    grid = (triton.cdiv(V, cfg["BV"]), HV, N)
    _CHUNK_STATE_BWD_KERNEL[grid](
        q, k, W, G, do, dv_local, dht if dht is not None else dh0,
        dh if store else dh0, dv if store else dh0, dh0,
        index.doc_offsets, index.doc_chunk_offsets,
        need if need is not None else index.doc_chunk_offsets, float(scale),
        H=H, HV=HV, K=K, V=V, GROUP=group, BT=index.chunk_size,
        BK=cfg["BK"], BV=cfg["BV"], USE_DHT=dht is not None, HAS_NEED=need is not None,
        STORE=store, DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dh, dv, dh0
