"""Backward stage (a): the chunk-local part of the gradient of ``v_new``.

Per chunk and value head ``hv`` (q/k head ``hv // group``)::

    dV'_local = scale · (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j])ᵀ dO

The transposed score matrix ``Pᵀ[j, i] = k_j · q_i`` is formed directly as
``K · Qᵀ`` with ``Qᵀ`` loaded through swapped pointer strides (no ``tl.trans``
of a dot result: Triton 3.6 miscompiles that pattern on Hopper). One program
per (chunk, value head) builds ``Pᵀ`` once and sweeps the V blocks.

Output ``dv_local: [T, HV, V]`` in the input dtype. No atomics; every element
is written by exactly one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile

__all__ = ["dv_local_bwd", "dv_local_config"]


@triton.jit
def _dv_local_kernel(
    q,
    k,
    G,
    do,
    dv,
    chunk_start,
    chunk_len,
    scale,
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
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // GROUP
    start = tl.load(chunk_start + i_c).to(tl.int64)
    L = tl.load(chunk_len + i_c)
    dt = k.dtype.element_ty

    o_t = tl.arange(0, BT)
    m_t = o_t < L
    rows = start + o_t  # int64 token indices

    # P^T[j, i] = k_j . q_i, accumulated over K blocks.
    b_pt = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_k = k + rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_qt = q + rows[None, :] * (H * K) + i_h * K + o_k[:, None]
        b_qt = tl.load(p_qt, mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_pt += tl.dot(b_k, b_qt, input_precision=DOT_PREC)

    b_g = tl.load(G + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    # row j, column i: keep i >= j inside the chunk.
    m_pt = (o_t[None, :] >= o_t[:, None]) & m_t[None, :] & m_t[:, None]
    decay = tl.exp(tl.where(m_pt, b_g[None, :] - b_g[:, None], float("-inf")))
    b_pt = (b_pt * decay * scale).to(dt)

    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        off_tv = rows[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        b_dv = tl.dot(b_pt, b_do, input_precision=DOT_PREC)
        tl.store(dv + off_tv, b_dv.to(dv.dtype.element_ty), mask=m_tv)


_DV_LOCAL_KERNEL = cached_launch(_dv_local_kernel)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get IEEE fp32 dots (no TF32 rounding); 16-bit inputs are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dv_local_config(K: int, V: int) -> dict:
    """Pinned launch configuration (the same in both modes). Three pipeline stages: the
    K-loop's loads overlap the dots (0.187 -> 0.145 ms at B1 T32768 H16 bf16 on the
    H200, ``benchmarks/gluon_dv_local_probe.py``); the dots' order is the same."""
    return {
        "BK": dot_tile(K, 64),
        "BV": dot_tile(V, 64),
        "num_warps": 4,
        "num_stages": 3,
    }


@launcher(uses_atomics=False, kernels=(_dv_local_kernel,))
def dv_local_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    G: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dv_local [T, HV, V]`` (input dtype) from ``q, k [T,H,K]``, ``G [T,HV]`` fp32,
    ``do [T,HV,V]``. ``out`` may supply the result buffer."""
    T, H, K = k.shape
    HV, V = do.shape[1], do.shape[2]
    if out is None:
        out = torch.empty(T, HV, V, dtype=k.dtype, device=k.device)
    NT = index.num_chunks
    if NT == 0:
        return out
    cfg = dv_local_config(K, V)
    _DV_LOCAL_KERNEL[(NT, HV)](
        q, k, G, do, out, index.chunk_start, index.chunk_len, float(scale),
        H=H, HV=HV, K=K, V=V, GROUP=group, BT=index.chunk_size,
        BK=cfg["BK"], BV=cfg["BV"], DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
