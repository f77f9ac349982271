"""Stage 2: the WY representation of each chunk.

Per chunk (``C = 64`` tokens) and value head::

    A_ij  = β_i (k_i·k_j) exp(G_i − G_j)     i > j, else 0
    A_inv = (I + A)^{-1}                       unit lower triangular
    W     = A_inv · diag(β exp(G)) · K         [C, K]
    U     = A_inv · diag(β) · V                [C, V]

One program per (chunk, value head), in three phases that meet in the
program's own ``[64, 64]`` fp32 slice of the ``A_inv`` output (L1/L2
resident), separated by CTA barriers:

1. ``A``: one ``[64, K] × [K, 64]`` tensor-core dot (``Kᵀ`` loaded through
   swapped strides, never ``tl.trans``), gated and masked in registers, stored.
2. the inverse: the four 16×16 diagonal blocks ``(I + a_b)^{-1}`` together by
   substitution on one stacked ``[64, 16]`` tile (row ``i`` ← ``e_i −
   Σ_{j<i} a_ij x_j``, computed on the transpose so that every sum stays inside
   a warp, the rows of ``a_b`` read back from memory: 15 dependent steps in
   all); then two levels of merges on tiles read back from memory,
   ``X_10 = −X_11 A_10 X_00`` (and ``X_32``) on 16×16 tiles and ``X_BL = −X_BR
   (A_BL X_TL)`` on 32×32 tiles. IEEE fp32 throughout; each finished block
   overwrites ``A``'s once nothing reads it any more.
3. ``W`` and ``U``: the full ``[64, 64]`` inverse read back and applied with one
   dot per 64-column tile (:func:`_wy_apply_tiles`). :func:`wy_apply`, which
   recomputes ``W, U`` from a stored ``A_inv``, runs this phase alone (the
   same kernel with ``INVERT=False``). For
   16-bit inputs both operands are rounded to the input type for a native
   16-bit dot (``W``/``U`` are stored in that type anyway); fp32 inputs take
   IEEE fp32 dots.

``GDN_CORE_WY_INV=reg`` (:func:`wy_inverse_choice`; unset or ``subst``: the kernel
above, whose bits the snapshot holds) runs another inverse with the same contract and
other bits (:func:`_wy_reg_body`): ``A`` from one whole-``K`` dot stays in registers, is
cut into its 32- and 16-blocks by reshapes, splits and joins, the four diagonal 16-blocks
are inverted together as a ``[4, 16, 16]`` batch by masked merges from 2×2 blocks up
(six batched IEEE dots instead of 15 substitution steps), then the same two merges as
above on their own tiles; the inverse is stored once (the fp32 one only where it is
returned) and phase 3 is :func:`_dot_rows` on it, so ``wy_apply`` on its ``A_inv``
gives its ``W``, ``U``. ``v`` is prefetched into L2 at the start (inline PTX, compiled
launches only); capped at 128 registers (124 used, no spills, 32 KiB shared on sm_90 with
Triton 3.6 at K = V = 128 bf16, against 123 and 16 KiB for the substitution kernel).

The pinned configuration (``num_warps=8``, 100 registers, no spills on sm_90)
was picked on the H200 among 4/8 warps × 16-bit/TF32 W/U dots × 1/2 stages:
0.47 ms against 0.93 ms for the previous kernel at T=32768, H=16, K=V=128
bf16 (``wy_apply`` alone 0.27 ms). No atomics, no autotuning: the program's
arithmetic is fixed, so the bits are the same run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile, unit_last
from gdn_core.switches import WY_INV_CHOICES, WY_INV_ENV, switch_choice

__all__ = ["inverse_for_backward", "wy_apply", "wy_config", "wy_fwd", "wy_inverse_choice"]


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
def _inv_diag_blocks(p_a, n, RS):
    """``Xᵀ`` of the four diagonal blocks ``X_b = (I + a_b)^{-1}``, stacked ``[64, 16]``.

    Row ``16 b + m`` holds column ``m`` of ``X_b``. Substitution on the
    transpose, all four blocks in one tile: step ``i`` sets column ``i`` to
    ``e_i − Σ_j a_b[i, j] (column j)`` (columns ``j < i`` are final, ``a_b`` is
    strictly lower), where row ``i`` of each ``a_b`` is read from the slice in
    memory as a ``[64, 16]`` broadcast. The sum runs along axis 1 (within a
    warp); 15 dependent steps for the four blocks together.
    """
    rr = tl.arange(0, 64)
    c = tl.arange(0, 16)
    blk = (rr // 16) * 16  # first row/column of each row's block
    xt = tl.where((rr % 16)[:, None] == c[None, :], 1.0, 0.0)
    for i in tl.static_range(1, 16):
        row = blk + i  # token of row i of each block
        a_i = tl.load(p_a + row[:, None] * RS + blk[:, None] + c[None, :],
                      mask=(row < n)[:, None], other=0.0)
        s = tl.sum(xt * a_i, axis=1)
        xt = tl.where(c[None, :] == i, xt - s[:, None], xt)
    return xt


@triton.jit
def _ld_sq(p_a, r0: tl.constexpr, c0: tl.constexpr, S: tl.constexpr, n, RS):
    """The ``S × S`` tile at (row ``r0``, column ``c0``) of the slice; rows ≥ ``n`` read 0."""
    r = tl.arange(0, S)
    t = r0 + r
    return tl.load(p_a + t[:, None] * RS + c0 + r[None, :], mask=(t < n)[:, None], other=0.0)


@triton.jit
def _st_sq(p_a, r0: tl.constexpr, c0: tl.constexpr, S: tl.constexpr, n, RS, x):
    r = tl.arange(0, S)
    t = r0 + r
    tl.store(p_a + t[:, None] * RS + c0 + r[None, :], x, mask=(t < n)[:, None])


@triton.jit
def _ieee(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _merge(x, a, r, c, S: tl.constexpr):
    """One merge level on stacked ``2S``-blocks: ``x`` holds the inverses of the ``S × S``
    diagonal blocks (zero elsewhere), ``a`` the matching tile of ``A``; returns the
    inverses of the ``2S × 2S`` blocks, ``X_10 = −X_11 (A_10 X_00)`` in each (the masked
    products add exact zeros only)."""
    m = ((r // S) % 2 == 1) & (c // S == r // S - 1)
    return x - _ieee(x, _ieee(tl.where(m, a, 0.0), x))


@triton.jit
def _quarters(x):
    """The four ``[S, S]`` quarters ``(top-left, bottom-left, top-right, bottom-right)`` of
    ``[.., 2S, 2S]`` tiles (leading batch dimension optional, rank 2 or 3)."""
    if len(x.shape) == 3:
        B: tl.constexpr = x.shape[0]
        S: tl.constexpr = x.shape[1] // 2
        q = tl.permute(tl.reshape(x, (B, 2, S, 2, S)), (0, 2, 4, 1, 3))  # [B, S, S, row, col]
    else:
        S: tl.constexpr = x.shape[0] // 2
        q = tl.permute(tl.reshape(x, (2, S, 2, S)), (1, 3, 0, 2))  # [S, S, row, col]
    left, right = tl.split(q)
    x00, x10 = tl.split(left)
    x01, x11 = tl.split(right)
    return x00, x10, x01, x11


@triton.jit
def _assemble(x00, x10, x01, x11):
    """Inverse of :func:`_quarters`: ``[[x00, x01], [x10, x11]]`` (rank 2 or 3)."""
    q = tl.join(tl.join(x00, x10), tl.join(x01, x11))  # [.., S, S, row, col]
    if len(x00.shape) == 3:
        B: tl.constexpr = x00.shape[0]
        S: tl.constexpr = x00.shape[1]
        return tl.reshape(tl.permute(q, (0, 3, 1, 4, 2)), (B, 2 * S, 2 * S))
    else:
        S: tl.constexpr = x00.shape[0]
        return tl.reshape(tl.permute(q, (2, 0, 3, 1)), (2 * S, 2 * S))


@triton.jit
def _stack2(x0, x1):
    """``[2, ..]`` from two equal tiles (``x0`` first)."""
    j = tl.join(x0, x1)  # [.., 2]
    if len(x0.shape) == 3:
        return tl.permute(j, (3, 0, 1, 2))
    else:
        return tl.permute(j, (2, 0, 1))


@triton.jit
def _unstack2(x):
    """Inverse of :func:`_stack2`."""
    if len(x.shape) == 4:
        return tl.split(tl.permute(x, (1, 2, 3, 0)))
    else:
        return tl.split(tl.permute(x, (1, 2, 0)))


@triton.jit
def _inv_reg(a):
    """``(I + a)^{-1}`` of a strictly lower ``[64, 64]`` fp32 tile in registers
    (``GDN_CORE_WY_INV=reg``): no memory, IEEE fp32 throughout.

    The tile is cut into its 32×32 and 16×16 blocks by reshapes, splits and joins (data
    movement only). The four diagonal 16-blocks are inverted together as one ``[4, 16,
    16]`` batch by merges from 2×2 blocks up (``I − a`` on the 2×2 diagonal blocks, then
    three masked batched merge levels); then the substitution kernel's two merges on
    their own tiles, ``X_10 = −X_11 (A_10 X_00)`` (both 32-halves as one ``[2, 16, 16]``
    batch) and ``X_BL = −X_BR (A_BL X_TL)`` (``[32, 32]``)."""
    a_tl, a_bl, a_tr, a_br = _quarters(a)
    halves = _stack2(a_tl, a_br)  # [2, 32, 32]: the diagonal 32-blocks
    d_e, a_s, d_z, d_o = _quarters(halves)  # [2, 16, 16] each: blocks 2h, 2h+1 below, -, 2h+1
    a_d = tl.reshape(tl.permute(tl.join(d_e, d_o), (0, 3, 1, 2)), (4, 16, 16))  # block 2h + p
    r = tl.arange(0, 16)[None, :, None]
    c = tl.arange(0, 16)[None, None, :]
    x = tl.where(r == c, 1.0, 0.0) - tl.where((r == c + 1) & (r % 2 == 1), a_d, 0.0)
    x = _merge(x, a_d, r, c, 2)
    x = _merge(x, a_d, r, c, 4)
    x = _merge(x, a_d, r, c, 8)
    # 16 → 32 on both halves: X_10 = −X_11 (A_10 X_00), X_32 = −X_33 (A_32 X_22)
    x_e, x_o = tl.split(tl.permute(tl.reshape(x, (2, 2, 16, 16)), (0, 2, 3, 1)))
    x_s = -_ieee(x_o, _ieee(a_s, x_e))
    x_tl, x_br = _unstack2(_assemble(x_e, x_s, tl.zeros_like(x_e), x_o))
    # 32 → 64: X_BL = −X_BR (A_BL X_TL)
    x_bl = -_ieee(x_br, _ieee(a_bl, x_tl))
    return _assemble(x_tl, x_bl, tl.zeros_like(x_tl), x_br)


@triton.jit
def _wy_apply_tiles(p_a, RSA, p_k, KS, p_w, WS, p_v, VS, p_u, US, g, beta, t, n, p_a16,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    PREC: tl.constexpr, DOT16: tl.constexpr, STORE_A16: tl.constexpr):
    """``W = A_inv diag(β e^G) K`` and ``U = A_inv diag(β) V`` for one chunk.

    ``p_a``: the chunk's ``[64, 64]`` fp32 ``A_inv`` (row stride ``RSA``);
    ``p_k``/``p_v``: its first key/value row (row strides ``KS``/``VS``);
    ``g``, ``beta``: ``[64]`` fp32 gate cumsum and write strength (0 past ``n``).
    ``DOT16``: round both operands to the output's 16-bit type and take a
    native 16-bit dot (else fp32 operands at precision ``PREC``). ``STORE_A16`` (with
    ``DOT16``): the rounded inverse is also stored at ``p_a16`` (the layout of ``p_a``):
    ``A_inv.to(dtype)``'s bits, which the backward reads, without a cast launch.
    """
    mt = t < n
    c = tl.arange(0, 64)
    a = tl.load(p_a + t[:, None] * RSA + c[None, :], mask=mt[:, None], other=0.0)
    if DOT16:
        a = a.to(p_w.dtype.element_ty)
        if STORE_A16:
            tl.store(p_a16 + t[:, None] * RSA + c[None, :], a, mask=mt[:, None])
    else:
        a = a.to(tl.float32)
    _dot_rows(a, p_k, KS, p_w, WS, beta * tl.exp(g), t, mt, K, BK, PREC, DOT16)
    if DOT16:
        a = a.to(p_u.dtype.element_ty)
    _dot_rows(a, p_v, VS, p_u, US, beta, t, mt, V, BV, PREC, DOT16)


@triton.jit
def _dot_rows(a, p_x, XS, p_o, OS, scale, t, mt, D: tl.constexpr, BD: tl.constexpr,
              PREC: tl.constexpr, DOT16: tl.constexpr):
    """``O = a · diag(scale) X`` over ``D`` columns in ``BD``-wide blocks: ``X`` and
    ``O`` rows ``t`` (masked by ``mt``) at row strides ``XS``/``OS``."""
    for i in range(0, tl.cdiv(D, BD)):
        c = i * BD + tl.arange(0, BD)
        mc = c < D
        y = _ld(p_x, t, mt, c, mc, XS).to(tl.float32) * scale[:, None]
        if DOT16:
            o = tl.dot(a, y.to(p_o.dtype.element_ty))
        else:
            o = tl.dot(a, y, input_precision=PREC)
        _st(p_o, t, mt, c, mc, OS, o)


@triton.jit
def _wy_kernel(
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
    VT,
    VH,
    A16,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DOT16: tl.constexpr,
    INVERT: tl.constexpr,
    STORE_A16: tl.constexpr,
    INV_REG: tl.constexpr = False,
    STORE_A32: tl.constexpr = True,
    KP: tl.constexpr = 16,
    VP: tl.constexpr = 16,
    PREFETCH: tl.constexpr = False,
):
    """One chunk × value head. ``INVERT``: phases 1–2 build ``A_inv`` in place
    (:func:`wy_fwd`); else ``A_inv`` is read as given (:func:`wy_apply`). ``VT``,
    ``VH``: ``v``'s token and head strides (a view of a packed projection is read
    in place). ``STORE_A16``: phase 3 also writes the inverse rounded to the 16-bit
    input type into ``A16`` (the backward's copy); ``A16`` is unused (``None``) otherwise.
    ``INV_REG`` (with ``INVERT``): the register variant (:func:`_wy_reg_body`); it writes
    the fp32 ``A_inv`` only with ``STORE_A32`` (``A_inv`` is ``None`` otherwise); ``KP``,
    ``VP``: ``K``, ``V`` rounded up to powers of two (its whole-``K`` dot, the prefetch's
    lines); ``PREFETCH``: it prefetches ``v`` into L2 (compiled launches only: inline
    PTX)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // GROUP
    bos = tl.load(chunk_start + i_c).to(tl.int64)
    n = tl.load(chunk_len + i_c)
    if INVERT and INV_REG:
        _wy_reg_body(k, v, beta, G, A_inv, W, U, A16, bos, n, i_h, i_hv, H, HV, VT, VH,
                     K, V, BK, BV, KP, VP, PREC, DOT16, STORE_A16, STORE_A32, PREFETCH)
    else:
        _wy_subst_body(k, v, beta, G, A_inv, W, U, A16, bos, n, i_h, i_hv, H, HV, VT, VH,
                       K, V, BK, BV, PREC, DOT16, INVERT, STORE_A16)


@triton.jit
def _prefetch_l2(p):
    """Start pulling the line at each address of ``p`` into L2 (``prefetch.global.L2``; no
    register is held for it, nothing waits for it). Compiled kernels only."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wy_reg_body(k, v, beta, G, A_inv, W, U, A16, bos, n, i_h, i_hv, H, HV, VT, VH,
                 K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 KP: tl.constexpr, VP: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
                 STORE_A16: tl.constexpr, STORE_A32: tl.constexpr, PREFETCH: tl.constexpr):
    """:func:`_wy_kernel` with ``GDN_CORE_WY_INV=reg``: ``A`` is one whole-``K`` dot kept in
    registers, inverted there (:func:`_inv_reg`) and stored once (fp32 only with
    ``STORE_A32``); ``W``, ``U`` are phase 3 of the substitution kernel
    (:func:`_dot_rows`) on the register inverse, so they are that kernel's function of
    ``A_inv``. ``PREFETCH``: ``v``'s lines are sent for into L2 first, so that phase 3
    finds them there."""
    t = tl.arange(0, 64)
    mt = t < n
    KS = H * K  # token stride of k
    RS = HV * 64  # token stride of A_inv
    p_k = k + bos * KS + i_h * K
    p_v = v + bos * VT + i_hv * VH
    if PREFETCH:  # one address in each 128-byte line of the chunk's rows (clamped to them)
        LINE: tl.constexpr = 128 // v.dtype.element_ty.primitive_bitwidth * 8  # elements a line
        if VP <= LINE:
            _prefetch_l2(p_v + tl.minimum(t, n - 1) * VT)
        else:
            cl = tl.minimum(tl.arange(0, VP // LINE) * LINE, V - 1)
            _prefetch_l2(p_v + tl.minimum(t, n - 1)[:, None] * VT + cl[None, :])
    ck = tl.arange(0, KP)
    mk = ck < K
    g = tl.load(G + bos * HV + i_hv + t * HV, mask=mt, other=0.0)
    b = tl.load(beta + bos * HV + i_hv + t * HV, mask=mt, other=0.0).to(tl.float32)
    # A = strict-lower( β_i exp(G_i − G_j) k_i·k_j ): one dot, gated in registers
    kk = tl.dot(_ld(p_k, t, mt, ck, mk, KS), _ld_t(p_k, t, mt, ck, mk, KS),
                input_precision=PREC)
    m = (t[:, None] > t[None, :]) & mt[:, None]
    e = tl.exp(tl.where(m, g[:, None] - g[None, :], 0.0))
    a = _inv_reg(tl.where(m, kk * e * b[:, None], 0.0))

    c = tl.arange(0, 64)
    if STORE_A32:
        tl.store(A_inv + bos * RS + i_hv * 64 + t[:, None] * RS + c[None, :], a,
                 mask=mt[:, None])
    if DOT16:
        a = a.to(W.dtype.element_ty)
        if STORE_A16:
            tl.store(A16 + bos * RS + i_hv * 64 + t[:, None] * RS + c[None, :], a,
                     mask=mt[:, None])
    _dot_rows(a, p_k, KS, W + bos * HV * K + i_hv * K, HV * K, b * tl.exp(g), t, mt, K, BK,
              PREC, DOT16)
    if DOT16:
        a = a.to(U.dtype.element_ty)
    _dot_rows(a, p_v, VT, U + bos * HV * V + i_hv * V, HV * V, b, t, mt, V, BV, PREC, DOT16)


@triton.jit
def _wy_subst_body(k, v, beta, G, A_inv, W, U, A16, bos, n, i_h, i_hv, H, HV, VT, VH,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   PREC: tl.constexpr, DOT16: tl.constexpr, INVERT: tl.constexpr,
                   STORE_A16: tl.constexpr):
    """:func:`_wy_kernel` as the module docstring describes it (``GDN_CORE_WY_INV=subst``,
    the default, and :func:`wy_apply`)."""
    t = tl.arange(0, 64)
    mt = t < n
    KS = H * K  # token stride of k
    RS = HV * 64  # token stride of A_inv
    p_k = k + bos * KS + i_h * K
    p_a = A_inv + bos * RS + i_hv * 64
    g = tl.load(G + bos * HV + i_hv + t * HV, mask=mt, other=0.0)
    b = tl.load(beta + bos * HV + i_hv + t * HV, mask=mt, other=0.0).to(tl.float32)

    if INVERT:
        # ---- phase 1: A = strict-lower( β_i exp(G_i − G_j) k_i·k_j ) ----
        kk = tl.zeros([64, 64], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            ck = i_k * BK + tl.arange(0, BK)
            mk = ck < K
            kk = tl.dot(_ld(p_k, t, mt, ck, mk, KS), _ld_t(p_k, t, mt, ck, mk, KS), kk,
                        input_precision=PREC)
        m = (t[:, None] > t[None, :]) & mt[:, None]
        e = tl.exp(tl.where(m, g[:, None] - g[None, :], 0.0))
        tl.store(p_a + t[:, None] * RS + t[None, :], tl.where(m, kk * e * b[:, None], 0.0),
                 mask=mt[:, None])
        tl.debug_barrier()

        # ---- phase 2: (I + A)^{-1} ----
        # diagonal blocks, written over A's (read only by the substitution)
        xt = _inv_diag_blocks(p_a, n, RS)
        rr = tl.arange(0, 64)
        c = tl.arange(0, 16)
        blk = (rr // 16) * 16
        tl.debug_barrier()
        tl.store(p_a + (blk[:, None] + c[None, :]) * RS + blk[:, None] + (rr % 16)[:, None], xt,
                 mask=(blk[:, None] + c[None, :]) < n)
        tl.debug_barrier()
        # 32×32 diagonal halves: X_10 = −X_11 A_10 X_00, X_32 = −X_33 A_32 X_22
        x10 = -_ieee(_ld_sq(p_a, 16, 16, 16, n, RS),
                     _ieee(_ld_sq(p_a, 16, 0, 16, n, RS), _ld_sq(p_a, 0, 0, 16, n, RS)))
        x32 = -_ieee(_ld_sq(p_a, 48, 48, 16, n, RS),
                     _ieee(_ld_sq(p_a, 48, 32, 16, n, RS), _ld_sq(p_a, 32, 32, 16, n, RS)))
        tl.debug_barrier()
        _st_sq(p_a, 16, 0, 16, n, RS, x10)
        _st_sq(p_a, 48, 32, 16, n, RS, x32)
        tl.debug_barrier()
        # the bottom-left half: X_BL = −X_BR (A_BL X_TL), 32×32 tiles
        x_bl = -_ieee(_ld_sq(p_a, 32, 32, 32, n, RS),
                      _ieee(_ld_sq(p_a, 32, 0, 32, n, RS), _ld_sq(p_a, 0, 0, 32, n, RS)))
        tl.debug_barrier()
        _st_sq(p_a, 32, 0, 32, n, RS, x_bl)
        tl.debug_barrier()

    # ---- phase 3: W, U ----
    if STORE_A16:
        p_a16 = A16 + bos * RS + i_hv * 64
    else:
        p_a16 = p_a  # unused
    _wy_apply_tiles(p_a, RS, p_k, KS, W + bos * HV * K + i_hv * K, HV * K,
                    v + bos * VT + i_hv * VH, VT, U + bos * HV * V + i_hv * V, HV * V,
                    g, b, t, n, p_a16, K, V, BK, BV, PREC, DOT16, STORE_A16)


_WY_KERNEL = cached_launch(_wy_kernel)


#: register cap of the register-inverse launch (``GDN_CORE_WY_INV=reg``) with 16-bit W/U
#: dots: two CTAs of 8 warps an SM. Uncapped, ptxas takes 151 registers at K = V = 128
#: bf16 (one CTA an SM); capped, 124 and no spills (``tools/sm90_report.py wy_inv``). At
#: K ≤ 64 the cap costs ~160 bytes of spills (uncapped: 195-211 registers). fp32 inputs
#: (IEEE W/U dots) are not capped: they spill either way.
WY_REG_MAXNREG = 128


def _check_dims(K: int, V: int) -> None:
    for name, d in (("K", K), ("V", V)):
        if d % 16 != 0 or not 16 <= d <= 256:
            raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")


def _check_inputs(k, v, beta, G, index: ChunkIndex, group: int) -> None:
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
        raise ValueError(f"the WY kernels need chunk size 64, got {index.chunk_size}")
    _check_dims(K, V)


def wy_config(K: int, V: int) -> dict[str, int]:
    """Pinned launch configuration of the WY kernels for head dims ``K, V``
    (``dot16``: 16-bit inputs take the 16-bit W/U dot, see :func:`_wy_apply_tiles`)."""
    return {
        "BK": dot_tile(K, 64),
        "BV": dot_tile(V, 64),
        "num_warps": 8,
        "num_stages": 1,
        "dot16": 1,
    }


@launcher(uses_atomics=False, kernels=(_wy_kernel,))
def wy_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    index: ChunkIndex,
    group: int,
    *,
    output_A_inv: bool = True,
    A_inv_for_backward: bool = False,
    output_WU: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """WY representation of every chunk.

    Args:
        k: ``[T, H, K]`` keys (bf16/fp16/fp32), head ``hv // group`` serves value head ``hv``.
        v: ``[T, HV, V]`` values, ``HV = H * group`` (read in place at its token
            and head strides when the last is 1).
        beta: ``[T, HV]`` write strengths.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (:func:`chunk_cumsum_fwd`).
        index: the chunk table (chunk size 64).
        group: value heads per q/k head.
        output_A_inv: also return ``A_inv`` (the forward pass does not need it;
            the kernel writes it either way, as its working memory).
        A_inv_for_backward: return ``A_inv`` as the backward reads it (the bits of
            :func:`inverse_for_backward` of the fp32 one): in ``k``'s 16-bit dtype,
            written by the kernel itself, where the W/U dots are 16-bit.
        output_WU: return ``W`` and ``U`` (when False both come back ``None``; this
            kernel forms them anyway, the Gluon one, ``wy_fwd_gluon``, does not).

    Returns:
        ``(A_inv, W, U)``: ``A_inv: [T, HV, 64]`` fp32 (row ``t`` = row of
        ``(I + A)^{-1}`` of its chunk, columns within the chunk, zero past the
        chunk's length; 16-bit with ``A_inv_for_backward``, see above) or ``None``;
        ``W: [T, HV, K]`` in ``k``'s dtype; ``U: [T, HV, V]`` in ``v``'s dtype.
    """
    _check_inputs(k, v, beta, G, index, group)
    reg = wy_inverse_choice() == "reg"
    shape = (k.shape[0], v.shape[1], 64)
    a16 = None
    if output_A_inv and A_inv_for_backward and _dot16(k, v):
        a16 = torch.empty(shape, dtype=k.dtype, device=k.device)
    # The substitution kernel builds the inverse in A_inv's memory: allocated either way.
    # The register one writes it only where it is returned.
    A_inv = None
    if not reg or (output_A_inv and a16 is None):
        A_inv = torch.empty(shape, dtype=torch.float32, device=k.device)
    W, U, grid, args, constexprs = _launch_spec(k, v, beta, G, A_inv, index, group, invert=True,
                                                a16=a16, reg=reg)
    if grid is not None:
        _WY_KERNEL[grid](*args, **constexprs)
    if not output_WU:
        W = U = None
    if not output_A_inv:
        return None, W, U
    return (a16 if a16 is not None else A_inv), W, U


def wy_inverse_choice() -> str:
    """How :func:`wy_fwd` inverts ``I + A``: ``GDN_CORE_WY_INV``
    (:data:`gdn_core.switches.WY_INV_ENV`, read at each call): ``"subst"`` (unset: the
    default) or ``"reg"`` (in registers; same contract, other bits).

    Raises:
        ValueError: the variable names another path.
    """
    return switch_choice(WY_INV_ENV, WY_INV_CHOICES, "subst")


def _compiled(x: torch.Tensor) -> bool:
    """Whether a launch on ``x``'s device runs compiled, so that inline PTX may be used:
    a CUDA tensor, and the kernel a compiled ``JITFunction`` (Triton decided that when this
    module was imported: with ``TRITON_INTERPRET=1`` it is an interpreted function)."""
    return x.is_cuda and isinstance(_wy_kernel, JITFunction)


def _dot16(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the W/U dots take 16-bit operands (pinned config, 16-bit inputs)."""
    return bool(wy_config(k.shape[2], v.shape[2])["dot16"]) and k.dtype != torch.float32 \
        and k.dtype == v.dtype


def inverse_for_backward(A_inv: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                         ) -> torch.Tensor:
    """``A_inv`` (from :func:`wy_fwd` on ``k, v``) as the backward reads it: in
    ``k``'s 16-bit dtype when the W/U dots round it to that type anyway (the WY
    backward does too), else as it is (fp32). A backward from it gets the bits
    it would get from recomputing the inverse, and it takes half the memory."""
    return A_inv.to(k.dtype) if _dot16(k, v) else A_inv


def _launch_spec(k, v, beta, G, A_inv, index: ChunkIndex, group: int, *, invert: bool,
                 a16: torch.Tensor | None = None, reg: bool = False):
    """``(W, U, grid, args, constexprs)`` of a :func:`_wy_kernel` launch (inputs checked
    by the caller); ``grid`` is ``None`` when there is nothing to launch. Each launcher
    makes the launch itself (no frame between it and the kernel). ``a16``: the buffer of
    the 16-bit inverse phase 3 also writes (:func:`wy_fwd`), else ``None``. ``reg``
    (with ``invert``): the register inverse; ``A_inv`` may then be ``None`` (not
    written)."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    k, beta = k.contiguous(), beta.contiguous()
    if A_inv is not None:
        A_inv = A_inv.contiguous()
    v = unit_last(v)
    G = G.contiguous().float()
    W = torch.empty(T, HV, K, dtype=k.dtype, device=k.device)
    U = torch.empty(T, HV, V, dtype=v.dtype, device=v.device)
    if index.num_chunks == 0 or HV == 0:
        return W, U, None, (), {}
    cfg = wy_config(K, V)
    args = (k, v, beta, G, A_inv, W, U, index.chunk_start, index.chunk_len, H, HV,
            v.stride(0), v.stride(1), a16)
    constexprs = dict(
        GROUP=group, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"],
        PREC="ieee" if k.dtype == torch.float32 else "tf32",
        DOT16=_dot16(k, v), INVERT=invert, STORE_A16=a16 is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if reg and invert:
        constexprs.update(INV_REG=True, STORE_A32=A_inv is not None,
                          KP=triton.next_power_of_2(K), VP=triton.next_power_of_2(V),
                          PREFETCH=_compiled(k))
        if constexprs["DOT16"]:
            constexprs["maxnreg"] = WY_REG_MAXNREG
    return W, U, (index.num_chunks, HV), args, constexprs


@launcher(uses_atomics=False, kernels=(_wy_kernel,))
def wy_apply(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    A_inv: torch.Tensor,
    index: ChunkIndex,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W, U`` of every chunk from a stored ``A_inv`` (what :func:`wy_fwd` returned,
    or :func:`inverse_for_backward` of it).

    Same arguments and results as :func:`wy_fwd` plus ``A_inv: [T, HV, 64]``,
    fp32 or (when the W/U dots take 16-bit operands) in ``k``'s dtype; the bits
    equal :func:`wy_fwd`'s ``W, U`` (the same tile routine).

    Raises:
        ValueError: on shape mismatches, an ``A_inv`` of another dtype, or
            unsupported head dims.
    """
    T, HV = k.shape[0], v.shape[1]
    allowed = (torch.float32, k.dtype) if _dot16(k, v) else (torch.float32,)
    if tuple(A_inv.shape) != (T, HV, 64) or A_inv.dtype not in allowed:
        raise ValueError(f"A_inv must be [T, HV, 64] = {(T, HV, 64)} in "
                         f"{' or '.join(str(d) for d in allowed)}, got "
                         f"{tuple(A_inv.shape)} {A_inv.dtype}")
    _check_inputs(k, v, beta, G, index, group)
    W, U, grid, args, constexprs = _launch_spec(k, v, beta, G, A_inv, index, group,
                                                invert=False)
    if grid is not None:
        _WY_KERNEL[grid](*args, **constexprs)
    return W, U
