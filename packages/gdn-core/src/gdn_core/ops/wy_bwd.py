"""Backward stage (d)+(e): WY backward and the dg assembly.

Forward (per chunk, value head ``hv``, q/k head ``hv // group``)::

    A_ij = β_i (k_i·k_j) exp(G_i − G_j)   (i > j),   T = (I + A)^{-1}
    W = T diag(βΓ) K,   U = T diag(β) V

Given ``dW`` and ``dU`` (= ``dV'``), with ``e_ij = exp(G_i − G_j)``::

    dT = dW (diag(βΓ)K)ᵀ + dU (diag(β)V)ᵀ,    dṼ = Tᵀ dU,    dv = β ⊙ dṼ
    E'  = (−Tᵀ dT Tᵀ) ⊙ e   on the strict lower triangle   (= dA ⊙ e)
    C  = Γ ⊙ (Tᵀ dW) + E' K,     D = β ⊙ C + E'ᵀ (diag(β) K)
    dk += D,    dβ = v·dṼ + k·C
    dg_t += Σ_{i ≥ t} β_i Γ_i k_i·(Tᵀ dW)_i + Σ_{i ≥ t} Σ_{j < t} Mw_ij,
            Mw = E' ⊙ diag(β) K Kᵀ  (= dA ⊙ A)

(``dL/dG_i = 2β_i k_i·C_i − k_i·D_i = β_i Γ_i k_i·(TᵀdW)_i + rowsum_i(Mw) −
colsum_i(Mw)``; its reverse cumsum keeps only the pairs of ``Mw`` crossing ``t``,
so no ``ε·O(1)`` of cancelled pairs is left on tokens whose ``dg`` is tiny, see
:mod:`gdn_core.ops.dqkwg`.) One program per (chunk, value head), four phases
that each keep at most three 64×64 fp32 tiles live:

1. one pass over ``dW, K`` then ``dU, V`` in 64-column blocks accumulates
   ``dT`` and writes ``dv`` (the only pass over ``dU`` and ``V``);
2. ``E'`` (fp32) from two 64×64×64 products;
3. ``K Kᵀ`` over 64-column blocks of ``K``, and ``dg``'s crossing sums of ``Mw``
   (from fp32 ``E'``); ``E'ᵀ`` goes through this program's slot of a global
   scratch (store, CTA barrier, load through swapped strides);
4. one pass over ``K, dW`` in 64-column blocks accumulates ``C`` then ``D`` in a
   single accumulator and updates ``dk``.

Triton 3.6 on Hopper miscompiles ``tl.trans`` of a ``tl.dot`` result fed to
another dot, so no dot result is ever transposed in registers: transposed
operands are loaded tiles (``tl.trans`` of a load is a shared-memory view) or
come back through memory. Tile offsets are 32-bit from scalar 64-bit bases, ``T`` is
loaded with a row-only mask (vectorised loads), and ``G`` is loaded after the ``dv``
stores so its broadcasts are not live through phase 1. For bf16 K=V=128 at the pinned
configuration ptxas (sm_90, Triton 3.6.0; ``tools/sm90_report.py bwd``) reports 168
registers (the cap; 249 uncapped), 64 bytes of spills, 3360 SASS instructions and 48
KiB of shared memory (before the crossing sums: 92 bytes of spills, 2712 instructions;
with 32-column blocks, before the pinned 64: no spills, 2424 instructions, 32 KiB).

The kernel then adds the dQ/dK stage's per-K-block ``dg`` partials (already in final
form, in a fixed order) and writes ``dg``/``dbeta`` in their dtypes. ``dk`` partials
``[T,HV,K]`` fp32 are updated (each element by one program): in place, or into
``dk_out`` in k's dtype when the caller has the whole sum here (one value head per q/k
head). No atomics. ``num_warps=4``: fla's WY-backward kernel was wrong at
``num_warps=4`` on Hopper/Triton 3.6; the previous kernel of this module (no
transposed dot results either) was checked on the H200 at num_warps 2, 4 and 8 with
identical errors against the fp32 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.dqkwg import crossing_sums
from gdn_core.ops.dv_local import dot_precision
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile

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
    dk_out,
    dg_part,
    dv,
    dbeta,
    dg,
    e_buf,
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

    # Scalar 64-bit bases for this chunk and head; tile offsets are 32-bit.
    k += start * (H * K) + i_h * K
    v += start * (HV * V) + i_hv * V
    du += start * (HV * V) + i_hv * V
    dv += start * (HV * V) + i_hv * V
    dw += start * (HV * K) + i_hv * K
    dk += start * (HV * K) + i_hv * K
    dk_out += start * (HV * K) + i_hv * K
    A_inv += start * (HV * BT) + i_hv * BT
    beta += start * HV + i_hv
    G += start * HV + i_hv
    e_buf += (i_c.to(tl.int64) * HV + i_hv) * (BT * BT)

    o_t = tl.arange(0, BT)
    m_t = o_t < L
    m_valid = m_t[:, None] & m_t[None, :]

    b_b = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_bg = b_b * tl.where(m_t, tl.exp(tl.load(G + o_t * HV, mask=m_t, other=0.0)), 0.0)

    # T^T: T loaded row-major (row mask only, so the loads vectorise), transposed
    # as a loaded operand (never a dot result: see the module docstring).
    b_T = tl.load(A_inv + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
    b_Tt = tl.trans(tl.where(m_valid, b_T, 0.0).to(dt))

    # Pass 1, the only pass over dU and V:  dT = dW (βΓK)^T + dU (βV)^T;
    # dṼ = T^T dU gives dv = β dṼ and dβ += v·dṼ.
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_dw = tl.load(dw + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0).to(dt)
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_kb = (b_k.to(tl.float32) * b_bg[:, None]).to(dt)
        b_dT = tl.dot(b_dw, tl.trans(b_kb), b_dT, input_precision=DOT_PREC)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        off_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        b_du = tl.load(du + off_tv, mask=m_tv, other=0.0).to(dt)
        b_v = tl.load(v + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dT = tl.dot(b_du, tl.trans((b_v * b_b[:, None]).to(dt)), b_dT, input_precision=DOT_PREC)
        b_dvb = tl.dot(b_Tt, b_du, input_precision=DOT_PREC)
        b_db += tl.sum(b_dvb * b_v, axis=1)
        tl.store(dv + off_tv, (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)

    # dA = -T^T dT T^T on the strict lower triangle;  E'_ij = dA_ij exp(G_i - G_j).
    # G is loaded only now (after the dv stores), so its broadcasts are not live
    # through pass 1.
    b_g = tl.load(G + o_t * HV, mask=m_t, other=0.0)
    b_gc = tl.load(G + o_t * HV, mask=m_t, other=0.0)
    m_low = (o_t[:, None] > o_t[None, :]) & m_valid
    b_x = tl.dot(b_dT.to(dt), b_Tt, input_precision=DOT_PREC)
    b_dA = tl.dot(b_Tt, b_x.to(dt), input_precision=DOT_PREC)
    b_E = tl.where(m_low, -b_dA * tl.exp(tl.where(m_low, b_g[:, None] - b_gc[None, :], 0.0)),
                   0.0)
    # dg's WY pair term: the pairs crossing each token of Mw = E' ⊙ diag(β) K Kᵀ
    # (fp32 E', K Kᵀ accumulated over K blocks).
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :],
                      mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
        b_kk = tl.dot(b_k, tl.trans(b_k), b_kk, input_precision=DOT_PREC)
    b_dg = crossing_sums(b_E * b_b[:, None] * b_kk, o_t)
    b_E = b_E.to(dt)
    # E'^T through this program's slot of a global scratch: stored, a CTA barrier,
    # loaded through swapped strides (a transposed dot result is never fed to a dot).
    o_e = o_t[:, None] * BT + o_t[None, :]
    tl.store(e_buf + o_e, b_E)
    tl.debug_barrier()
    b_Et = tl.load(e_buf + o_t[None, :] * BT + o_t[:, None])

    # Pass 2 over K blocks, one accumulator:  C = Γ ⊙ T^T dW + E' K,  then
    # D = β ⊙ C + E'^T (βK);  dk += D,  dβ += k·C;  dg's row term Γ k·(T^T dW).
    b_gam = tl.where(m_t, tl.exp(b_g), 0.0)
    b_wr = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        off_tk = o_t[:, None] * (HV * K) + o_k[None, :]
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_dw = tl.load(dw + off_tk, mask=m_tk, other=0.0).to(dt)
        b_acc = tl.dot(b_Tt, b_dw, input_precision=DOT_PREC) * b_gam[:, None]
        b_kf = b_k.to(tl.float32)
        b_wr += tl.sum(b_acc * b_kf, axis=1)
        b_acc = tl.dot(b_E, b_k, b_acc, input_precision=DOT_PREC)
        b_db += tl.sum(b_acc * b_kf, axis=1)
        b_kb = (b_kf * b_b[:, None]).to(dt)
        b_acc = tl.dot(b_Et, b_kb, b_acc * b_b[:, None], input_precision=DOT_PREC)
        b_acc += tl.load(dk + off_tk, mask=m_tk, other=0.0)
        tl.store(dk_out + off_tk, b_acc.to(dk_out.dtype.element_ty), mask=m_tk)

    # dg = crossing(Mw) + revcumsum(β Γ k·(T^T dW)) + the dQ/dK stage's partials
    # (already in that form), added in a fixed order.
    b_dg += tl.cumsum(b_b * b_wr, axis=0, reverse=True)
    p_s = (start + o_t) * HV + i_hv
    for i in range(NKG):
        b_dg += tl.load(dg_part + i * T * HV + p_s, mask=m_t, other=0.0)
    tl.store(dg + p_s, b_dg.to(dg.dtype.element_ty), mask=m_t)
    tl.store(dbeta + p_s, b_db.to(dbeta.dtype.element_ty), mask=m_t)


def wy_bwd_config(K: int, V: int) -> dict:
    """Pinned launch configuration: 64-column blocks, ``num_stages=2`` and a
    168-register cap. H200, bf16 K=V=128, B1 T32768 H16 8 documents
    (``benchmarks/kernel_variants.py``, 2026-12-01): 0.575 ms a call against 0.734 with
    32-column blocks (the same ``dk`` bits), 1.09 ms at 8 warps; 64 is also the width
    Triton 3.6 gets right in every measured kernel (:mod:`gdn_core.ops.tiles`)."""
    return {
        "BK": dot_tile(K, 64),
        "BV": dot_tile(V, 64),
        "num_warps": 4,
        "num_stages": 2,
        "maxnreg": 168,
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
    scratch: torch.Tensor | None = None,
    dk_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """WY backward + dG assembly.

    ``k: [T,H,K]``; ``v, du: [T,HV,V]``; ``beta: [T,HV]``; ``G: [T,HV]`` fp32;
    ``A_inv: [T,HV,C]``; ``dw: [T,HV,K]``; ``dk: [T,HV,K]`` fp32 partials, updated
    in place, or — given ``dk_out`` (``[T,HV,K]``, any float dtype, e.g. k's when
    ``group == 1`` makes the partial the final ``dk``) — left as they are while
    ``dk_out`` receives the sums; ``dg_part: [NK,T,HV]`` fp32 (the dQ/dK stage's
    ``dg`` partials, in final form: added to this stage's ``dg`` as they are).

    Returns ``(dk_out or dk, dv [T,HV,V] in v's dtype, dbeta [T,HV] in beta's dtype,
    dg [T,HV] in g_dtype)``. The kernel needs ``NT·HV·C·C`` elements of scratch in
    k's dtype (the transposes of ``E'``, one 64×64 tile per program, written before
    they are read): ``scratch`` lends them (any contiguous tensor of k's dtype and
    device that large, e.g. a workspace buffer whose contents are spent), else
    they are allocated.

    Raises:
        ValueError: ``scratch`` of another dtype or device, not contiguous, or too small.
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dev = k.device
    if dv is None:
        dv = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    dbeta = torch.empty(T, HV, dtype=beta.dtype, device=dev)
    dg = torch.empty(T, HV, dtype=g_dtype, device=dev)
    NT = index.num_chunks
    if dk_out is None:
        dk_out = dk
    elif tuple(dk_out.shape) != tuple(dk.shape) or not dk_out.is_contiguous():
        raise ValueError(f"dk_out must be a contiguous {tuple(dk.shape)} tensor, got "
                         f"{tuple(dk_out.shape)} (contiguous={dk_out.is_contiguous()})")
    if NT == 0:
        return dk_out, dv, dbeta, dg
    cfg = wy_bwd_config(K, V)
    C = index.chunk_size
    if scratch is None:
        e_buf = torch.empty(NT, HV, C, C, dtype=k.dtype, device=dev)
    else:
        if (scratch.dtype != k.dtype or scratch.device != dev or not scratch.is_contiguous()
                or scratch.numel() < NT * HV * C * C):
            raise ValueError(
                f"scratch must be a contiguous {k.dtype} tensor on {dev} with at least "
                f"{NT * HV * C * C} elements, got {scratch.dtype} on {scratch.device} with "
                f"{scratch.numel()} (contiguous={scratch.is_contiguous()})")
        e_buf = scratch.view(-1)[: NT * HV * C * C]
    _wy_bwd_kernel[(NT, HV)](
        k, v, beta, G, A_inv, dw, du, dk, dk_out, dg_part, dv, dbeta, dg, e_buf,
        index.chunk_start, index.chunk_len, T,
        H=H, HV=HV, K=K, V=V, GROUP=group, NKG=dg_part.shape[0], BT=index.chunk_size,
        BK=cfg["BK"], BV=cfg["BV"], DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
    )
    return dk_out, dv, dbeta, dg
