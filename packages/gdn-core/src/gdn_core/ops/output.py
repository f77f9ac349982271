"""Stage 4: the chunk output.

Per chunk, value head and block of value columns::

    O = scale · ( diag(exp G) Q h_c + (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j]) V' )

``Q h_c`` and ``Q Kᵀ`` are accumulated over blocks of ``K`` (``Kᵀ`` loaded
through transposed pointer strides, no ``tl.trans``); the decay
``exp(G_i − G_j)`` is evaluated only where ``i ≥ j`` (the exponent is masked
before ``exp``, so it can't overflow). One program per (value block, chunk,
value head); no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile

__all__ = ["chunk_output_fwd", "chunk_output_config"]


@triton.jit
def _chunk_output_fwd_kernel(
    q,
    k,
    v_new,
    h,
    G,
    o,
    chunk_start,
    chunk_len,
    scale,
    H,
    HV,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_c = tl.program_id(1).to(tl.int64)
    i_hv = tl.program_id(2)
    i_h = i_hv // GROUP
    bos = tl.load(chunk_start + i_c).to(tl.int64)
    n = tl.load(chunk_len + i_c)

    rt = tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    mt = rt < n
    mv = rv < V
    KS = H * K
    p_q = q + bos * KS + i_h * K
    p_k = k + bos * KS + i_h * K
    p_h = h + (i_c * HV + i_hv) * K * V

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_a = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        mk = rk < K
        m_tk = mt[:, None] & mk[None, :]
        b_q = tl.load(p_q + rt[:, None] * KS + rk[None, :], mask=m_tk, other=0.0)
        # Kᵀ [BK, BT] through transposed strides
        m_kt = mk[:, None] & mt[None, :]
        b_kt = tl.load(p_k + rt[None, :] * KS + rk[:, None], mask=m_kt, other=0.0)
        m_kv = mk[:, None] & mv[None, :]
        b_h = tl.load(p_h + rk[:, None] * V + rv[None, :], mask=m_kv, other=0.0)
        b_o = tl.dot(b_q, b_h.to(b_q.dtype), b_o, input_precision=PREC)
        b_a = tl.dot(b_q, b_kt, b_a, input_precision=PREC)

    b_g = tl.load(G + (bos + rt) * HV + i_hv, mask=mt, other=0.0)
    b_o = b_o * tl.exp(b_g)[:, None]
    causal = (rt[:, None] >= rt[None, :]) & mt[:, None]
    b_a = tl.where(causal, b_a * tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    p_vn = v_new + (bos + rt[:, None]) * HV * V + i_hv * V + rv[None, :]
    b_vn = tl.load(p_vn, mask=mt[:, None] & mv[None, :], other=0.0)
    b_o = tl.dot(b_a.to(b_vn.dtype), b_vn, b_o, input_precision=PREC)
    p_o = o + (bos + rt[:, None]) * HV * V + i_hv * V + rv[None, :]
    tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=mt[:, None] & mv[None, :])


_CHUNK_OUTPUT_FWD_KERNEL = cached_launch(_chunk_output_fwd_kernel)


def chunk_output_config(K: int, V: int) -> dict[str, int]:
    """Pinned launch configuration of the output kernel for head dims ``K, V``."""
    BK = dot_tile(K, 64)
    BV = dot_tile(V, 64)
    return {"BK": BK, "BV": BV, "num_warps": 4, "num_stages": 2}


@launcher(uses_atomics=False, kernels=(_chunk_output_fwd_kernel,))
def chunk_output_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    G: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
) -> torch.Tensor:
    """Output of every chunk.

    Args:
        q, k: ``[T, H, K]`` (the same q/k the states were built from), head
            ``hv // group`` serves value head ``hv``.
        v_new: ``[T, HV, V]`` from :func:`chunk_state_fwd`.
        h: ``[NT, HV, K, V]`` states entering each chunk, from :func:`chunk_state_fwd`.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g``.
        scale: the output scale (usually ``K ** -0.5``).
        index: the chunk table.
        group: value heads per key head.

    Returns:
        ``o: [T, HV, V]`` in ``q``'s dtype.
    """
    T, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    NT = index.num_chunks
    if (
        tuple(k.shape) != (T, H, K)
        or v_new.shape[0] != T
        or HV != H * group
        or tuple(h.shape) != (NT, HV, K, V)
        or tuple(G.shape) != (T, HV)
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v_new {tuple(v_new.shape)}, "
            f"h {tuple(h.shape)}, G {tuple(G.shape)}, group {group}, chunks {NT}"
        )
    for name, d in (("K", K), ("V", V)):
        if d % 16 != 0 or not 16 <= d <= 256:
            raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")
    q, k, v_new, h, G = (x.contiguous() for x in (q, k, v_new, h, G))
    if G.dtype != torch.float32:
        G = G.float()
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    if NT == 0 or HV == 0:
        return o
    cfg = chunk_output_config(K, V)
    grid = (triton.cdiv(V, cfg["BV"]), NT, HV)
    _CHUNK_OUTPUT_FWD_KERNEL[grid](
        q, k, v_new, h, G, o, index.chunk_start, index.chunk_len, float(scale), H, HV,
        GROUP=group, K=K, V=V, BT=index.chunk_size, BK=cfg["BK"], BV=cfg["BV"],
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o
