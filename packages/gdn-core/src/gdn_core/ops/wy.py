"""Stage 2: the WY representation of each chunk.

Per chunk (``C = 64`` tokens) and value head::

    A_ij  = β_i (k_i·k_j) exp(G_i − G_j)     i > j, else 0
    A_inv = (I + A)^{-1}                       unit lower triangular
    W     = A_inv · diag(β exp(G)) · K         [C, K]
    U     = A_inv · diag(β) · V                [C, V]

One program per (chunk, value head). The 64×64 system is handled as 4×4
blocks of 16×16. The six off-diagonal blocks of ``A`` are 16-row dots (``Kᵀ``
loaded through transposed pointer strides, never ``tl.trans``); the four
diagonal blocks come from one batched ``[4, 16, 16]`` dot, whose layout keeps
each block inside one warp. Those four blocks are inverted together by row
substitution on the ``[4, 16, 16]`` stack: step ``i`` sets row ``i`` to
``e_i − Σ_{j<i} a_ij x_j`` with one broadcast multiply and one 16-long sum
(warp-local), so the dependent chain is 15 short vector steps instead of
15 dependent 16×16 dots per block. The off-diagonal blocks of the inverse
follow by two levels of 32×32 merges, ``X_10 = −X_11 A_10 X_00`` (likewise
``X_32``), then ``X_BL = −X_BR (A_BL X_TL)`` with independent products formed
side by side (a dependent depth of 4 dots instead of 6). W and U are 16-row block
products of the inverse with the scaled K / V tiles. Everything is accumulated
in fp32; the dots building ``A`` and W / U use IEEE precision for fp32 inputs
and TF32 otherwise, the inverse (substitution and merges) is always IEEE fp32.
No atomics, no autotuning: the program's arithmetic is fixed, so the bits are
the same run to run.
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
def _gate_block(a, g_i, g_j, b_i, t_i, t_j, n):
    """Scale a raw ``k_i·k_j`` block by ``β_i exp(G_i − G_j)`` on ``j < i < n``, else 0."""
    m = (t_i[:, None] > t_j[None, :]) & (t_i[:, None] < n)
    e = tl.exp(tl.where(m, g_i[:, None] - g_j[None, :], 0.0))
    return tl.where(m, a * e * b_i[:, None], 0.0)


@triton.jit
def _store_a_row(p, t, n, x0, x1, x2, x3, RS):
    """Store one 16-row block of A_inv (its four 16-column blocks)."""
    r = tl.arange(0, 16)
    off = t[:, None] * RS + r[None, :]
    m = t[:, None] < n
    tl.store(p + off, x0, mask=m)
    tl.store(p + off + 16, x1, mask=m)
    tl.store(p + off + 32, x2, mask=m)
    tl.store(p + off + 48, x3, mask=m)


@triton.jit
def _ld(p, t, mt, c, mc, RS):
    """Load rows ``t`` (token offsets, row stride ``RS``) × columns ``c`` → ``[len(t), len(c)]``."""
    return tl.load(p + t[:, None] * RS + c[None, :], mask=mt[:, None] & mc[None, :], other=0.0)


@triton.jit
def _ld_t(p, t, mt, c, mc, RS):
    """Transposed view of :func:`_ld` read straight from memory → ``[len(c), len(t)]``."""
    return tl.load(p + t[None, :] * RS + c[:, None], mask=mt[None, :] & mc[:, None], other=0.0)


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
    t0 = r
    t1 = r + 16
    t2 = r + 32
    t3 = r + 48
    m0 = t0 < n
    m1 = t1 < n
    m2 = t2 < n
    m3 = t3 < n

    KS = H * K  # token stride of k
    p_k = k + bos * KS + i_h * K
    p_g = G + bos * HV + i_hv
    p_b = beta + bos * HV + i_hv
    g0 = tl.load(p_g + t0 * HV, mask=m0, other=0.0)
    g1 = tl.load(p_g + t1 * HV, mask=m1, other=0.0)
    g2 = tl.load(p_g + t2 * HV, mask=m2, other=0.0)
    g3 = tl.load(p_g + t3 * HV, mask=m3, other=0.0)
    b0 = tl.load(p_b + t0 * HV, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(p_b + t1 * HV, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(p_b + t2 * HV, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(p_b + t3 * HV, mask=m3, other=0.0).to(tl.float32)

    # ---- A = K Kᵀ: the six off-diagonal blocks as 16×16 dots, the four
    # diagonal blocks as one batched [4, 16, 16] dot ----
    rb = tl.arange(0, 4)
    tr3 = rb[:, None, None] * 16 + r[None, :, None]  # token of row (b, i)
    tc3 = rb[:, None, None] * 16 + r[None, None, :]  # token of column (b, j)
    mr3 = tr3 < n
    mc3 = tc3 < n
    a10 = tl.zeros([16, 16], dtype=tl.float32)
    a20 = tl.zeros([16, 16], dtype=tl.float32)
    a21 = tl.zeros([16, 16], dtype=tl.float32)
    a30 = tl.zeros([16, 16], dtype=tl.float32)
    a31 = tl.zeros([16, 16], dtype=tl.float32)
    a32 = tl.zeros([16, 16], dtype=tl.float32)
    d = tl.zeros([4, 16, 16], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = ck < K
        k1 = _ld(p_k, t1, m1, ck, mk, KS)
        k2 = _ld(p_k, t2, m2, ck, mk, KS)
        k3 = _ld(p_k, t3, m3, ck, mk, KS)
        # transposed views [BK, 16] straight from memory
        kt0 = _ld_t(p_k, t0, m0, ck, mk, KS)
        kt1 = _ld_t(p_k, t1, m1, ck, mk, KS)
        kt2 = _ld_t(p_k, t2, m2, ck, mk, KS)
        a10 = tl.dot(k1, kt0, a10, input_precision=PREC)
        a20 = tl.dot(k2, kt0, a20, input_precision=PREC)
        a21 = tl.dot(k2, kt1, a21, input_precision=PREC)
        a30 = tl.dot(k3, kt0, a30, input_precision=PREC)
        a31 = tl.dot(k3, kt1, a31, input_precision=PREC)
        a32 = tl.dot(k3, kt2, a32, input_precision=PREC)
        # [4, 16, BK] rows and [4, BK, 16] transposed columns of the diagonal blocks
        kb = tl.load(
            p_k + tr3 * KS + ck[None, None, :], mask=mr3 & mk[None, None, :], other=0.0
        )
        kbt = tl.load(
            p_k + tc3 * KS + ck[None, :, None], mask=mc3 & mk[None, :, None], other=0.0
        )
        d = tl.dot(kb, kbt, d, input_precision=PREC)

    a10 = _gate_block(a10, g1, g0, b1, t1, t0, n)
    a20 = _gate_block(a20, g2, g0, b2, t2, t0, n)
    a21 = _gate_block(a21, g2, g1, b2, t2, t1, n)
    a30 = _gate_block(a30, g3, g0, b3, t3, t0, n)
    a31 = _gate_block(a31, g3, g1, b3, t3, t1, n)
    a32 = _gate_block(a32, g3, g2, b3, t3, t2, n)

    # Diagonal blocks, transposed: at[b, j, i] = a_b[i, j] = β_i exp(G_i − G_j) k_i·k_j
    # for j < i < n (k_i·k_j is symmetric, so d serves as its own transpose).
    pd = rb[:, None] * 16 + r[None, :]
    md = pd < n
    gd = tl.load(p_g + pd * HV, mask=md, other=0.0)
    bd = tl.load(p_b + pd * HV, mask=md, other=0.0).to(tl.float32)
    mt = (tc3 > tr3) & mc3
    et = tl.exp(tl.where(mt, gd[:, None, :] - gd[:, :, None], 0.0))
    at = tl.where(mt, d * et * bd[:, None, :], 0.0)

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

    if STORE_A:
        z = tl.zeros([16, 16], dtype=tl.float32)
        p_a = A_inv + bos * HV * 64 + i_hv * 64
        _store_a_row(p_a, t0, n, x00, z, z, z, HV * 64)
        _store_a_row(p_a, t1, n, x10, x11, z, z, HV * 64)
        _store_a_row(p_a, t2, n, x20, x21, x22, z, HV * 64)
        _store_a_row(p_a, t3, n, x30, x31, x32, x33, HV * 64)

    # ---- W = A_inv diag(β exp(G)) K ----
    e0 = b0 * tl.exp(g0)
    e1 = b1 * tl.exp(g1)
    e2 = b2 * tl.exp(g2)
    e3 = b3 * tl.exp(g3)
    p_w = W + bos * HV * K + i_hv * K
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = ck < K
        y0 = _ld(p_k, t0, m0, ck, mk, KS)
        y1 = _ld(p_k, t1, m1, ck, mk, KS)
        y2 = _ld(p_k, t2, m2, ck, mk, KS)
        y3 = _ld(p_k, t3, m3, ck, mk, KS)
        y0 = y0.to(tl.float32) * e0[:, None]
        y1 = y1.to(tl.float32) * e1[:, None]
        y2 = y2.to(tl.float32) * e2[:, None]
        y3 = y3.to(tl.float32) * e3[:, None]
        w0 = tl.dot(x00, y0, input_precision=PREC)
        w1 = tl.dot(x11, y1, tl.dot(x10, y0, input_precision=PREC), input_precision=PREC)
        w2 = tl.dot(x20, y0, input_precision=PREC)
        w2 = tl.dot(x21, y1, w2, input_precision=PREC)
        w2 = tl.dot(x22, y2, w2, input_precision=PREC)
        w3 = tl.dot(x30, y0, input_precision=PREC)
        w3 = tl.dot(x31, y1, w3, input_precision=PREC)
        w3 = tl.dot(x32, y2, w3, input_precision=PREC)
        w3 = tl.dot(x33, y3, w3, input_precision=PREC)
        _st(p_w, t0, m0, ck, mk, HV * K, w0)
        _st(p_w, t1, m1, ck, mk, HV * K, w1)
        _st(p_w, t2, m2, ck, mk, HV * K, w2)
        _st(p_w, t3, m3, ck, mk, HV * K, w3)

    # ---- U = A_inv diag(β) V ----
    p_v = v + bos * HV * V + i_hv * V
    p_u = U + bos * HV * V + i_hv * V
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = cv < V
        y0 = _ld(p_v, t0, m0, cv, mv, HV * V)
        y1 = _ld(p_v, t1, m1, cv, mv, HV * V)
        y2 = _ld(p_v, t2, m2, cv, mv, HV * V)
        y3 = _ld(p_v, t3, m3, cv, mv, HV * V)
        y0 = y0.to(tl.float32) * b0[:, None]
        y1 = y1.to(tl.float32) * b1[:, None]
        y2 = y2.to(tl.float32) * b2[:, None]
        y3 = y3.to(tl.float32) * b3[:, None]
        u0 = tl.dot(x00, y0, input_precision=PREC)
        u1 = tl.dot(x11, y1, tl.dot(x10, y0, input_precision=PREC), input_precision=PREC)
        u2 = tl.dot(x20, y0, input_precision=PREC)
        u2 = tl.dot(x21, y1, u2, input_precision=PREC)
        u2 = tl.dot(x22, y2, u2, input_precision=PREC)
        u3 = tl.dot(x30, y0, input_precision=PREC)
        u3 = tl.dot(x31, y1, u3, input_precision=PREC)
        u3 = tl.dot(x32, y2, u3, input_precision=PREC)
        u3 = tl.dot(x33, y3, u3, input_precision=PREC)
        _st(p_u, t0, m0, cv, mv, HV * V, u0)
        _st(p_u, t1, m1, cv, mv, HV * V, u1)
        _st(p_u, t2, m2, cv, mv, HV * V, u2)
        _st(p_u, t3, m3, cv, mv, HV * V, u3)


def _check_dims(K: int, V: int) -> None:
    for name, d in (("K", K), ("V", V)):
        if d % 16 != 0 or not 16 <= d <= 256:
            raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")


def wy_config(K: int, V: int) -> dict[str, int]:
    """Pinned launch configuration of the WY kernel for head dims ``K, V``."""
    return {
        "BK": min(64, triton.next_power_of_2(K)),
        "BV": min(64, triton.next_power_of_2(V)),
        "num_warps": 4,
        "num_stages": 1,
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
    cfg = wy_config(K, V)
    _wy_fwd_kernel[(NT, HV)](
        k, v, beta, G, A_inv, W, U, index.chunk_start, index.chunk_len, H, HV,
        GROUP=group, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"], STORE_A=output_A_inv,
        PREC="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return A_inv, W, U
