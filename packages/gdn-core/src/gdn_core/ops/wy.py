"""Stage 2: the WY representation of each chunk.

Per chunk (``C = 64`` tokens) and value head::

    A_ij  = β_i (k_i·k_j) exp(G_i − G_j)     i > j, else 0
    A_inv = (I + A)^{-1}                       unit lower triangular
    W     = A_inv · diag(β exp(G)) · K         [C, K]
    U     = A_inv · diag(β) · V                [C, V]

One program per (chunk, value head), 4 warps. The 64×64 system is handled
as 4×4 blocks of 16×16, kept in ``[4, 16, 16]`` stacks whose batch axis the
batched dot layout puts one block per warp:

1. ``A``: four batched dots per K tile give the stacks ``S_δ[b] = K_b K_{b−δ}ᵀ``
   (δ = 0 the diagonal blocks, δ = 1, 2, 3 the sub-diagonals; the rows of block
   ``b−δ`` are loaded as their own tile, masked where ``b < δ``, and fed through
   ``tl.permute`` of the loaded tile, never of a dot result), then gated by
   ``β_i exp(G_i − G_j)`` in place.
2. Diagonal blocks of the inverse, all four at once, by row substitution:
   step ``i`` sets row ``i`` to ``e_i − Σ_{j<i} a_ij x_j`` with one broadcast
   multiply and one 16-long warp-local sum. The rows of ``a`` come out of the
   gated *transposed* diagonal stack (``k_i·k_j`` is symmetric) and do not
   depend on ``x``, so the dependent chain is 15 short vector steps (it was 15
   dependent 16×16 dots per block).
3. Off-diagonal blocks of the inverse by two levels of 32×32 merges on
   ``[16, 16]`` blocks: ``X_10 = −X_11 A_10 X_00`` (likewise ``X_32``), then
   ``X_BL = −X_BR (A_BL X_TL)`` with the independent products formed side by
   side (a dependent depth of 4 dots; it was 6).
4. The blocks are joined into the full 64×64 inverse (``tl.join`` / permute /
   reshape, no arithmetic), and W and U are one 64-row dot per K / V tile.

The inverse is IEEE fp32 throughout (the substitution is elementwise fp32,
the merges are IEEE dots); the dots building ``A`` and W / U use IEEE for
fp32 inputs and TF32 otherwise, accumulating in fp32. No atomics, no
autotuning, a pinned configuration (:func:`wy_config`): the same bits run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.registry import launcher

__all__ = ["wy_fwd", "wy_config"]


@triton.jit
def _inv_diag4(at):
    """``(I + a_b)^{-1}`` for the four diagonal blocks at once, ``at: [4, 16, 16]`` fp32.

    ``at[b]`` is the *transpose* of block ``b``'s strictly lower triangular
    ``a_b`` (``at[b, j, i] = a_b[i, j]``), so that row ``i`` of ``a_b`` comes
    out of ``at`` as a vector along the row axis. Row substitution: starting
    from ``x = I``, step ``i`` sets row ``i`` to ``e_i − Σ_{j<i} a_ij x_j`` (rows
    ``j < i`` are final by then, ``a_ij = 0`` for ``j ≥ i``), i.e. one broadcast
    multiply and one 16-long sum per step, for all four blocks together. The
    extraction of ``a``'s row does not depend on ``x``, so the dependent chain is
    15 multiply-sum-select steps (no dot, no layout round trip through memory).
    """
    r = tl.arange(0, 16)
    i3 = r[None, :, None]
    j3 = r[None, None, :]
    x = tl.where(i3 == j3, 1.0, 0.0) + tl.zeros([4, 16, 16], dtype=tl.float32)
    for i in tl.static_range(1, 16):
        a_i = tl.sum(tl.where(j3 == i, at, 0.0), axis=2)  # [4, 16]: a_b[i, j] over j
        s = tl.sum(a_i[:, :, None] * x, axis=1)  # [4, 16]: Σ_j a_ij x_j
        x = tl.where(i3 == i, x - s[:, None, :], x)
    return x


@triton.jit
def _pick(x, b: tl.constexpr):
    """Block ``b`` of a ``[4, 16, 16]`` stack as a ``[16, 16]`` tensor."""
    rb = tl.arange(0, 4)
    return tl.sum(tl.where(rb[:, None, None] == b, x, 0.0), axis=0)


@triton.jit
def _gate_stack(s, gr, br, p_g, p2, m2, HV, DELTA: tl.constexpr):
    """Gate the stack of blocks ``A_{b, b−DELTA}``: ``β_i exp(G_i − G_j)`` on rows ``i < n``
    of blocks ``b ≥ DELTA`` (``gr``, ``br``: ``[4, 16]`` G and β of the rows), else 0."""
    sb = p2 >= DELTA * 16  # [b, ·]: block b has a block DELTA to its left
    gc = tl.load(p_g + (p2 - DELTA * 16) * HV, mask=sb, other=0.0)  # G of the columns
    m = (sb & m2)[:, :, None] & sb[:, None, :]
    e = tl.exp(tl.where(m, gr[:, :, None] - gc[:, None, :], 0.0))
    return tl.where(m, s * e * br[:, :, None], 0.0)


@triton.jit
def _hcat4(x0, x1, x2, x3):
    """``[x0 | x1 | x2 | x3]``: four ``[16, 16]`` blocks side by side → ``[16, 64]``."""
    y = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # y[i, j, p, q] = x_{2p+q}[i, j]
    return tl.reshape(tl.permute(y, (0, 2, 3, 1)), (16, 64))


@triton.jit
def _vcat4(x0, x1, x2, x3):
    """``[x0; x1; x2; x3]``: four ``[16, 64]`` block rows stacked → ``[64, 64]``."""
    y = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # y[i, c, p, q] = x_{2p+q}[i, c]
    return tl.reshape(tl.permute(y, (2, 3, 0, 1)), (64, 64))


@triton.jit
def _ld(p, t, mt, c, mc, RS):
    """Load rows ``t`` (token offsets, row stride ``RS``) × columns ``c`` → ``[len(t), len(c)]``."""
    return tl.load(p + t[:, None] * RS + c[None, :], mask=mt[:, None] & mc[None, :], other=0.0)


@triton.jit
def _st(p, t, mt, c, mc, RS, x):
    m = mt[:, None] & mc[None, :]
    tl.store(p + t[:, None] * RS + c[None, :], x.to(p.dtype.element_ty), mask=m)


@triton.jit
def _wy_fwd_kernel(
    k,
    v,
    beta,
    G,
    A_inv,
    W,
    U,
    chunk_start,
    chunk_len,
    H,
    HV,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    STORE_A: tl.constexpr,
    PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // GROUP
    bos = tl.load(chunk_start + i_c).to(tl.int64)
    n = tl.load(chunk_len + i_c)

    r = tl.arange(0, 16)

    KS = H * K  # token stride of k
    p_k = k + bos * KS + i_h * K
    p_g = G + bos * HV + i_hv
    p_b = beta + bos * HV + i_hv

    # ---- A = K Kᵀ as four batched [4, 16, 16] dots, one block per warp ----
    # Stack δ holds the blocks A_{b, b−δ} (b ≥ δ; the others are zero): δ = 0 the
    # diagonal, δ = 1, 2, 3 the sub-diagonals. Rows of block b−δ are loaded as
    # their own tile (masked where b < δ) and fed transposed (tl.permute of a
    # loaded tile, never of a dot result).
    rb = tl.arange(0, 4)
    b3 = rb[:, None, None]
    tr3 = b3 * 16 + r[None, :, None]  # token of row i of block b
    mr3 = tr3 < n
    s0 = tl.zeros([4, 16, 16], dtype=tl.float32)
    s1 = tl.zeros([4, 16, 16], dtype=tl.float32)
    s2 = tl.zeros([4, 16, 16], dtype=tl.float32)
    s3 = tl.zeros([4, 16, 16], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = (i_k * BK + tl.arange(0, BK))[None, None, :]
        mk = ck < K
        k0 = tl.load(p_k + tr3 * KS + ck, mask=mr3 & mk, other=0.0)
        k1 = tl.load(p_k + (tr3 - 16) * KS + ck, mask=(tr3 - 16 < n) & (b3 >= 1) & mk, other=0.0)
        k2 = tl.load(p_k + (tr3 - 32) * KS + ck, mask=(tr3 - 32 < n) & (b3 >= 2) & mk, other=0.0)
        k3 = tl.load(p_k + (tr3 - 48) * KS + ck, mask=(tr3 - 48 < n) & (b3 >= 3) & mk, other=0.0)
        s0 = tl.dot(k0, tl.permute(k0, (0, 2, 1)), s0, input_precision=PREC)
        s1 = tl.dot(k0, tl.permute(k1, (0, 2, 1)), s1, input_precision=PREC)
        s2 = tl.dot(k0, tl.permute(k2, (0, 2, 1)), s2, input_precision=PREC)
        s3 = tl.dot(k0, tl.permute(k3, (0, 2, 1)), s3, input_precision=PREC)

    # gates: A_ij = β_i exp(G_i − G_j) k_i·k_j for j < i < n
    p2 = rb[:, None] * 16 + r[None, :]  # [4, 16] token of (b, i)
    m2 = p2 < n
    gr = tl.load(p_g + p2 * HV, mask=m2, other=0.0)
    br = tl.load(p_b + p2 * HV, mask=m2, other=0.0).to(tl.float32)
    s1 = _gate_stack(s1, gr, br, p_g, p2, m2, HV, 1)
    s2 = _gate_stack(s2, gr, br, p_g, p2, m2, HV, 2)
    s3 = _gate_stack(s3, gr, br, p_g, p2, m2, HV, 3)
    a10 = _pick(s1, 1)
    a21 = _pick(s1, 2)
    a32 = _pick(s1, 3)
    a20 = _pick(s2, 2)
    a31 = _pick(s2, 3)
    a30 = _pick(s3, 3)
    # Diagonal blocks, transposed: at[b, j, i] = a_b[i, j] (k_i·k_j is symmetric,
    # so s0 serves as its own transpose); row i of a_b = column i of at.
    tc3 = b3 * 16 + r[None, None, :]
    mt = (tc3 > tr3) & (tc3 < n)
    et = tl.exp(tl.where(mt, gr[:, None, :] - gr[:, :, None], 0.0))
    at = tl.where(mt, s0 * et * br[:, None, :], 0.0)

    # ---- (I + A)^{-1}: diagonal blocks by row substitution, then the merges ----
    xd = _inv_diag4(at)
    x00 = _pick(xd, 0)
    x11 = _pick(xd, 1)
    x22 = _pick(xd, 2)
    x33 = _pick(xd, 3)
    # 32×32 halves: X_TL = [[x00, 0], [x10, x11]], X_BR = [[x22, 0], [x32, x33]]
    x10 = -tl.dot(x11, tl.dot(a10, x00, input_precision="ieee"), input_precision="ieee")
    x32 = -tl.dot(x33, tl.dot(a32, x22, input_precision="ieee"), input_precision="ieee")
    # X_BL = −X_BR (A_BL X_TL), A_BL = [[a20, a21], [a30, a31]]
    p01 = tl.dot(a21, x11, input_precision="ieee")
    p11 = tl.dot(a31, x11, input_precision="ieee")
    p00 = tl.dot(a21, x10, tl.dot(a20, x00, input_precision="ieee"), input_precision="ieee")
    p10 = tl.dot(a31, x10, tl.dot(a30, x00, input_precision="ieee"), input_precision="ieee")
    x20 = -tl.dot(x22, p00, input_precision="ieee")
    x21 = -tl.dot(x22, p01, input_precision="ieee")
    # the two products of each bottom-row block are independent: add them after
    x30 = -(tl.dot(x33, p10, input_precision="ieee") + tl.dot(x32, p00, input_precision="ieee"))
    x31 = -(tl.dot(x33, p11, input_precision="ieee") + tl.dot(x32, p01, input_precision="ieee"))

    # ---- assemble the full 64×64 inverse once (joins, no dots) ----
    z = tl.zeros([16, 16], dtype=tl.float32)
    x = _vcat4(
        _hcat4(x00, z, z, z),
        _hcat4(x10, x11, z, z),
        _hcat4(x20, x21, x22, z),
        _hcat4(x30, x31, x32, x33),
    )
    tc = tl.arange(0, 64)
    mc = tc < n
    if STORE_A:
        p_a = A_inv + bos * HV * 64 + i_hv * 64
        _st(p_a, tc, mc, tc, tc < 64, HV * 64, x)

    # ---- W = A_inv diag(β exp(G)) K,  U = A_inv diag(β) V: one 64-row dot per tile ----
    gc = tl.load(p_g + tc * HV, mask=mc, other=0.0)
    bc = tl.load(p_b + tc * HV, mask=mc, other=0.0).to(tl.float32)
    ec = bc * tl.exp(gc)
    p_w = W + bos * HV * K + i_hv * K
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = ck < K
        y = _ld(p_k, tc, mc, ck, mk, KS).to(tl.float32) * ec[:, None]
        _st(p_w, tc, mc, ck, mk, HV * K, tl.dot(x, y, input_precision=PREC))
    p_v = v + bos * HV * V + i_hv * V
    p_u = U + bos * HV * V + i_hv * V
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = cv < V
        y = _ld(p_v, tc, mc, cv, mv, HV * V).to(tl.float32) * bc[:, None]
        _st(p_u, tc, mc, cv, mv, HV * V, tl.dot(x, y, input_precision=PREC))


def _check_dims(K: int, V: int) -> None:
    for name, d in (("K", K), ("V", V)):
        if d % 16 != 0 or not 16 <= d <= 256:
            raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")


def wy_config(K: int, V: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Pinned launch configuration of the WY kernel for head dims ``K, V`` and input dtype.

    16-bit inputs: 64-wide K / V tiles, and a register cap of 168 per thread so
    that three 4-warp programs fit on an SM (the uncapped build takes ~177
    registers, i.e. two). fp32 inputs (IEEE FMA dots, a correctness path):
    32-wide tiles, no cap.
    """
    fp32 = dtype == torch.float32
    cap = 32 if fp32 else 64
    return {
        "BK": min(cap, triton.next_power_of_2(K)),
        "BV": min(cap, triton.next_power_of_2(V)),
        "num_warps": 4,
        "num_stages": 1,
        "maxnreg": None if fp32 else 168,
    }


@launcher(uses_atomics=False, kernels=(_wy_fwd_kernel,))
def wy_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    index: ChunkIndex,
    group: int,
    *,
    output_A_inv: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """WY representation of every chunk.

    Args:
        k: ``[T, H, K]`` keys (bf16/fp16/fp32), head ``hv // group`` serves value head ``hv``.
        v: ``[T, HV, V]`` values, ``HV = H * group``.
        beta: ``[T, HV]`` write strengths.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (:func:`chunk_cumsum_fwd`).
        index: the chunk table (chunk size 64).
        group: value heads per q/k head.
        output_A_inv: also return ``A_inv`` (the forward pass does not need it).

    Returns:
        ``(A_inv, W, U)``: ``A_inv: [T, HV, 64]`` fp32 (row ``t`` = row of
        ``(I + A)^{-1}`` of its chunk, columns within the chunk, zero past the
        chunk's length) or ``None``; ``W: [T, HV, K]`` in ``k``'s dtype;
        ``U: [T, HV, V]`` in ``v``'s dtype.
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    if v.shape[0] != T or HV != H * group or tuple(beta.shape) != (T, HV) or tuple(G.shape) != (
        T,
        HV,
    ):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}, "
            f"G {tuple(G.shape)}, group {group}"
        )
    if index.chunk_size != 64:
        raise ValueError(f"wy_fwd needs chunk size 64, got {index.chunk_size}")
    _check_dims(K, V)
    k, v, beta, G = (x.contiguous() for x in (k, v, beta, G))
    if G.dtype != torch.float32:
        G = G.float()
    A_inv = (
        torch.empty(T, HV, 64, dtype=torch.float32, device=k.device) if output_A_inv else None
    )
    W = torch.empty(T, HV, K, dtype=k.dtype, device=k.device)
    U = torch.empty(T, HV, V, dtype=v.dtype, device=v.device)
    NT = index.num_chunks
    if NT == 0 or HV == 0:
        return A_inv, W, U
    cfg = wy_config(K, V, k.dtype)
    _wy_fwd_kernel[(NT, HV)](
        k, v, beta, G, A_inv, W, U, index.chunk_start, index.chunk_len, H, HV,
        GROUP=group, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"], STORE_A=output_A_inv,
        PREC="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
    )
    return A_inv, W, U
