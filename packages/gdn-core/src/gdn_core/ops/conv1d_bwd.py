"""Triton backward of the short causal depthwise conv1d (:mod:`gdn_core.conv1d`).

One program per (fixed block of :data:`CONV_BWD_TOKEN_BLOCK` tokens of a row,
block of ``BD`` channels, row), walking its block in sub-tiles of ``BT``
tokens, in order. For a sub-tile it recomputes, once per token ``t``, the
pre-activation and ``g(t) = dy(t) · act'(pre(t))``, keeps ``g`` in a ring of
two sub-tiles (the program's own ``[2·BT, BD]`` fp32 slice of a scratch
buffer, row = token mod ``2·BT``, CTA barriers around its writes), and one
sub-tile behind forms

    dx[t]      = Σ_j g(t + j) · weight[:, W-1-j]   (j ≤ run(t): t + j in t's document)
    dweight_i += Σ_t g(t) · x[t - i]      (the taps the pre-activation read)
    dbias     += Σ_t g(t)

so besides ``dx`` only the per-block partials and the ring (a transient
``[B · blocks · 2·BT, D]`` fp32 buffer, mostly cache-resident) are written — no
stored activations. The last sub-tile's ``dx`` waits for the ``g`` of the tile
after the block (computed for its first ``W-1`` tokens). The halo gradient
(``dhalo [B, W-1, D]``) is the same ``dx`` sum for the slots ``t = -(W-1) …
-1``, done by the programs of the first block while the ring holds the first
sub-tile. The sums run in the order of the earlier form, which recomputed ``g``
for each of the ``W`` outputs a token feeds: the same bits.

**Reductions.** ``dweight``/``dbias`` are sums over every token: each program
writes its block's fp32 partial ``[W+1, BD]`` (its sub-tiles added in order)
to a workspace ``[B · blocks, W+1 (padded), D]``, and a second kernel adds the
partials of each column strictly in row order (``b``, then block) and writes
``dweight [D, W]`` / ``dbias [D]`` in their dtypes. No atomics; the block grid
is a function of ``T`` alone (a constant token block, not the device or the
launch), so the bits are the same on every call, in every process.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.ops.conv1d import _ACT, CONV_BLOCK_D, _load_tap, doc_source
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["CONV_BWD_BLOCK_T", "CONV_BWD_TOKEN_BLOCK", "conv1d_bwd"]

#: tokens per sub-tile of a backward program
CONV_BWD_BLOCK_T = 16
#: tokens per backward program: one fp32 partial of dweight/dbias per block (a constant)
CONV_BWD_TOKEN_BLOCK = 256
_REDUCE_ROWS = 8
_REDUCE_COLS = 256


@triton.jit
def _doc_run(t, T, cu, n_cu, steps, pos, W: tl.constexpr, MODE: tl.constexpr):
    """``(start(t), run(t))``: the first token of ``t``'s document and how many of the
    next ``W-1`` tokens belong to it (``t + k`` is in the document iff ``k <= run``);
    tokens ``t < 0`` (halo slots) belong to the document at token 0."""
    tc = tl.minimum(tl.maximum(t, 0), T - 1)
    if MODE == 1:  # one search gives both ends: cu[lo] <= t < cu[lo + 1]
        lo = tl.zeros_like(tc)
        hi = lo + (n_cu - 1)
        for _ in range(steps):
            mid = (lo + hi + 1) // 2
            ok = tl.load(cu + mid).to(tl.int64) <= tc
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        start = tl.load(cu + lo).to(tl.int64)
        run = tl.minimum(tl.load(cu + lo + 1).to(tl.int64) - 1 - t, W - 1)
    elif MODE == 2:  # t + k continues t's document iff doc_pos[t + k] == doc_pos[t] + k
        pt = tl.where(t < 0, t, tl.load(pos + tc).to(tl.int64))
        start = tc - tl.maximum(pt, 0)
        run = tl.zeros_like(tc)
        cont = t < T
        for k in tl.static_range(1, W):
            pk = t + k
            pkc = tl.minimum(tl.maximum(pk, 0), T - 1)
            cont = cont & (pk < T) & ((pk < 0) | (tl.load(pos + pkc).to(tl.int64) == pt + k))
            run += cont.to(tl.int64)
    else:
        start = tl.zeros_like(tc)
        run = tl.minimum(T - 1 - t, W - 1)
    return start, run


@triton.jit
def _tap(x, halo, i_b, t, k, st, run, o_d, m_d, T, D, sxb, sxt, sxd, W: tl.constexpr,
         HAS_HALO: tl.constexpr):
    """``x[t + k]`` where it lies in ``t``'s document (before ``t``: at or after its
    start, or the halo for the document at token 0; after ``t``: ``k <= run``), else
    zero (not loaded). The mask depends on ``k`` alone, so the repeated taps of the
    backward are one load each."""
    if k > 0:
        ok = k <= run
    else:
        ok = (t + k >= st) | (st == 0)
    return _load_tap(x, halo, i_b, t + k, ok, o_d, m_d, T, D, sxb, sxt, sxd, W, HAS_HALO)


@triton.jit
def _pick(i: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7):
    """``x_i`` of eight values (``i`` a compile-time index: no select is emitted)."""
    if i == 0:
        r = x0
    elif i == 1:
        r = x1
    elif i == 2:
        r = x2
    elif i == 3:
        r = x3
    elif i == 4:
        r = x4
    elif i == 5:
        r = x5
    elif i == 6:
        r = x6
    else:
        r = x7
    return r


@triton.jit
def _weight_column(w, o_d, m_d, swd, sww, i: tl.constexpr, W: tl.constexpr):
    """Column ``i`` of ``weight [D, W]`` as fp32 ``[BD]`` (zeros for ``i >= W``)."""
    if i < W:
        r = tl.load(w + o_d * swd + i * sww, mask=m_d, other=0.0).to(tl.float32)
    else:
        r = tl.zeros_like(o_d).to(tl.float32)
    return r


@triton.jit
def _g_tile(x, halo, w0, w1, w2, w3, w4, w5, w6, w7, b_b, dy, i_b, o_t, o_d, m_d, T, D, cu,
            n_cu, steps, pos, sxb, sxt, sxd, syb, syt, syd, W: tl.constexpr,
            ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr,
            MODE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """``(g, x_0 … x_7, start, run)`` of the tokens ``o_t``: ``g(t) = dy(t) · act'(pre(t))``
    (fp32 ``[BT, BD]``, zero outside ``[0, T)``), the taps ``x_i = x[t - i]`` its
    pre-activation read (zero outside ``t``'s document; ``x_i`` for ``i >= W`` unused),
    and ``t``'s document start and run (:func:`_doc_run`). ``w0 … w7``: the weight's
    columns (fp32 ``[BD]``); ``b_b``: the bias (read if ``HAS_BIAS``)."""
    st, run = _doc_run(o_t, T, cu, n_cu, steps, pos, W, MODE)
    if HAS_BIAS:
        pre = tl.zeros([BT, BD], dtype=tl.float32) + b_b[None, :]
    else:
        pre = tl.zeros([BT, BD], dtype=tl.float32)
    x0 = _tap(x, halo, i_b, o_t, 0, st, run, o_d, m_d, T, D, sxb, sxt, sxd, W, HAS_HALO)
    pre += x0 * _pick(W - 1, w0, w1, w2, w3, w4, w5, w6, w7)[None, :]
    x1 = x0
    x2 = x0
    x3 = x0
    x4 = x0
    x5 = x0
    x6 = x0
    x7 = x0
    for i in tl.static_range(1, W):
        b_x = _tap(x, halo, i_b, o_t, -i, st, run, o_d, m_d, T, D, sxb, sxt, sxd, W, HAS_HALO)
        pre += b_x * _pick(W - 1 - i, w0, w1, w2, w3, w4, w5, w6, w7)[None, :]
        if i == 1:
            x1 = b_x
        elif i == 2:
            x2 = b_x
        elif i == 3:
            x3 = b_x
        elif i == 4:
            x4 = b_x
        elif i == 5:
            x5 = b_x
        elif i == 6:
            x6 = b_x
        else:
            x7 = b_x
    inside = (o_t >= 0) & (o_t < T)
    tc = tl.minimum(tl.maximum(o_t, 0), T - 1)
    g = tl.load(dy + i_b * syb + tc[:, None] * syt + o_d[None, :] * syd,
                mask=inside[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    if ACT == 1:
        sg = tl.sigmoid(pre)
        g = g * (sg * (1.0 + pre * (1.0 - sg)))
    g = tl.where(inside[:, None], g, 0.0)
    return g, x0, x1, x2, x3, x4, x5, x6, x7, st, run


@triton.jit
def _dx_from_ring(ring, o_t, run, T, w0, w1, w2, w3, w4, w5, w6, w7, W: tl.constexpr,
                  BT: tl.constexpr, BD: tl.constexpr):
    """``dx[t] = Σ_j g(t + j) · weight[:, W-1-j]`` over the ``j`` whose token ``t + j``
    continues ``t``'s document (``j <= run(t)``; ``t`` itself for ``j = 0`` when it lies
    in ``[0, T)``), ``g`` read from the program's ring (row = token mod ``2·BT``), in
    ``j`` order."""
    c = tl.arange(0, BD)
    dx = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        s = o_t + j
        if j == 0:
            same = (s >= 0) & (s < T)
        else:
            same = (s >= 0) & (j <= run)
        r = tl.maximum(s, 0) % (2 * BT)  # rows of s < 0 are masked off
        g = tl.load(ring + r[:, None] * BD + c[None, :], mask=same[:, None], other=0.0)
        dx += g * _pick(W - 1 - j, w0, w1, w2, w3, w4, w5, w6, w7)[None, :]
    return dx


@triton.jit
def _dhalo_from_ring(ring, dhalo, i_b, o_d, m_d, T, D, cu, n_cu, steps, pos, w0, w1, w2, w3,
                     w4, w5, w6, w7, W: tl.constexpr, MODE: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr):
    """``dhalo`` of row ``i_b`` (the slots ``t = -(W-1) … -1``, the document at token 0)
    from the ring while it holds the first sub-tile's ``g``."""
    o_t = tl.arange(0, BT).to(tl.int64) - BT
    st, run = _doc_run(o_t, T, cu, n_cu, steps, pos, W, MODE)
    b_dh = _dx_from_ring(ring, o_t, run, T, w0, w1, w2, w3, w4, w5, w6, w7, W, BT, BD)
    oh = tl.minimum(tl.maximum(o_t + (W - 1), 0), W - 2)
    tl.store(dhalo + (i_b * (W - 1) + oh[:, None]) * D + o_d[None, :],
             b_dh.to(dhalo.dtype.element_ty), mask=(o_t >= 1 - W)[:, None] & m_d[None, :])


@triton.jit
def _conv1d_bwd_kernel(x, halo, w, bias, dy, dx, dhalo, part, ring, cu, pos, T, D, n_cu, steps,
                       sxb, sxt, sxd, syb, syt, syd, swd, sww, W: tl.constexpr,
                       WP: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_HALO: tl.constexpr, MODE: tl.constexpr, BT: tl.constexpr,
                       BD: tl.constexpr, SUB: tl.constexpr):
    i_k, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    c = tl.arange(0, BD)
    # this program's ring of g: [2·BT, BD] fp32, row = token mod 2·BT (L1/L2 resident)
    ring += ((i_b * tl.num_programs(0) + i_k) * tl.num_programs(1) + i_d) * (2 * BT * BD)
    # the weight's columns and the bias, once per program (not per sub-tile)
    w0 = _weight_column(w, o_d, m_d, swd, sww, 0, W)
    w1 = _weight_column(w, o_d, m_d, swd, sww, 1, W)
    w2 = _weight_column(w, o_d, m_d, swd, sww, 2, W)
    w3 = _weight_column(w, o_d, m_d, swd, sww, 3, W)
    w4 = _weight_column(w, o_d, m_d, swd, sww, 4, W)
    w5 = _weight_column(w, o_d, m_d, swd, sww, 5, W)
    w6 = _weight_column(w, o_d, m_d, swd, sww, 6, W)
    w7 = _weight_column(w, o_d, m_d, swd, sww, 7, W)
    if HAS_BIAS:
        b_b = tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    else:
        b_b = tl.zeros_like(o_d).to(tl.float32)
    # per-lag sums of g(t) · x[t - i] (and of g for the bias), kept as [BT, BD] tiles
    # and reduced over tokens once, after the block: no cross-thread sum per sub-tile
    a0 = tl.zeros([BT, BD], dtype=tl.float32)
    a1 = tl.zeros([BT, BD], dtype=tl.float32)
    a2 = tl.zeros([BT, BD], dtype=tl.float32)
    a3 = tl.zeros([BT, BD], dtype=tl.float32)
    a4 = tl.zeros([BT, BD], dtype=tl.float32)
    a5 = tl.zeros([BT, BD], dtype=tl.float32)
    a6 = tl.zeros([BT, BD], dtype=tl.float32)
    a7 = tl.zeros([BT, BD], dtype=tl.float32)
    ab = tl.zeros([BT, BD], dtype=tl.float32)
    # the sub-tiles holding tokens (the last block of a row may be short), in order: each
    # g is computed once and kept in the ring, and dx of a sub-tile, which reads g(t …
    # t + W-1), follows one sub-tile behind (the last one's after the tile that follows
    # the block, computed for its first W-1 tokens)
    n_sub = tl.minimum(SUB, tl.cdiv(T - i_k * (SUB * BT), BT))
    o_prev = tl.arange(0, BT).to(tl.int64)  # the sub-tile whose dx is pending, its run
    run_prev = tl.zeros([BT], dtype=tl.int64)
    for it in range(0, n_sub + 1):
        o_t = (i_k.to(tl.int64) * SUB + it) * BT + tl.arange(0, BT)
        g, x0, x1, x2, x3, x4, x5, x6, x7, st, run = _g_tile(
            x, halo, w0, w1, w2, w3, w4, w5, w6, w7, b_b, dy, i_b, o_t, o_d, m_d, T, D, cu,
            n_cu, steps, pos, sxb, sxt, sxd, syb, syt, syd, W, ACT, HAS_BIAS, HAS_HALO, MODE,
            BT, BD)
        tl.debug_barrier()  # the reads of these rows (two sub-tiles back) are done
        tl.store(ring + (o_t % (2 * BT))[:, None] * BD + c[None, :], g)
        tl.debug_barrier()
        if HAS_HALO:
            if (i_k == 0) & (it == 0):  # the halo slots t = -(W-1) .. -1: g(t + j) is tile 0's
                _dhalo_from_ring(ring, dhalo, i_b, o_d, m_d, T, D, cu, n_cu, steps, pos, w0, w1,
                                 w2, w3, w4, w5, w6, w7, W, MODE, BT, BD)
        if it > 0:
            b_dx = _dx_from_ring(ring, o_prev, run_prev, T, w0, w1, w2, w3, w4, w5, w6, w7, W,
                                 BT, BD)
            tl.store(dx + (i_b * T + o_prev[:, None]) * D + o_d[None, :],
                     b_dx.to(dx.dtype.element_ty), mask=(o_prev < T)[:, None] & m_d[None, :])
        if it < n_sub:  # g(t) is zero for t >= T
            a0 += g * x0
            if W > 1:
                a1 += g * x1
            if W > 2:
                a2 += g * x2
            if W > 3:
                a3 += g * x3
            if W > 4:
                a4 += g * x4
            if W > 5:
                a5 += g * x5
            if W > 6:
                a6 += g * x6
            if W > 7:
                a7 += g * x7
            if HAS_BIAS:
                ab += g
        o_prev = o_t
        run_prev = run
    r_w = tl.arange(0, WP)
    acc = tl.zeros([WP, BD], dtype=tl.float32)  # row W-1-i: dweight column of lag i; row W: dbias
    for i in tl.static_range(W):
        part_i = tl.sum(_pick(i, a0, a1, a2, a3, a4, a5, a6, a7), axis=0)
        acc = tl.where(r_w[:, None] == W - 1 - i, part_i[None, :], acc)
    if HAS_BIAS:
        acc = tl.where(r_w[:, None] == W, tl.sum(ab, axis=0)[None, :], acc)
    row = i_b * tl.num_programs(0) + i_k
    tl.store(part + (row * WP + r_w[:, None]) * D + o_d[None, :], acc,
             mask=(r_w[:, None] < WP) & m_d[None, :])


@triton.jit
def _conv1d_partials_sum_kernel(part, dw, db, R, D, swd, sww, W: tl.constexpr,
                                WP: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr,
                                BM: tl.constexpr):
    """Column sums of ``part [R, WP, D]`` (rows ``BR`` at a time, in row order) →
    ``dw [D, W]`` (row ``W-1-i`` of a partial is column ``W-1-i``), ``db [D]``."""
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    M = WP * D
    m_m = o_m < M
    r = tl.arange(0, BR)
    acc = tl.zeros([BM], dtype=tl.float32)
    for r0 in range(0, R, BR):
        rr = (r0 + r).to(tl.int64)
        blk = tl.load(part + rr[:, None] * M + o_m[None, :],
                      mask=(rr < R)[:, None] & m_m[None, :], other=0.0)
        acc += tl.sum(blk, axis=0)
    col = o_m // D
    d = o_m % D
    tl.store(dw + d * swd + col * sww, acc.to(dw.dtype.element_ty), mask=m_m & (col < W))
    if HAS_BIAS:
        tl.store(db + d, acc.to(db.dtype.element_ty), mask=m_m & (col == W))


_CONV1D_BWD_KERNEL = cached_launch(_conv1d_bwd_kernel)
_CONV1D_PARTIALS_SUM_KERNEL = cached_launch(_conv1d_partials_sum_kernel)


@launcher(uses_atomics=False, kernels=(_conv1d_bwd_kernel, _conv1d_partials_sum_kernel))
def conv1d_bwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               dy: torch.Tensor, activation: str | None, offsets: list[int] | None,
               halo: torch.Tensor | None, doc_pos: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward on validated inputs → ``(dx, dweight, dbias, dhalo)`` as
    :func:`gdn_core.conv1d.causal_conv1d_bwd` (``dx`` contiguous in ``x``'s dtype;
    ``dweight [D, W]``, ``dbias``, ``dhalo`` in their inputs' dtypes). ``x``, ``dy``
    any strides; the rest as :func:`gdn_core.ops.conv1d.conv1d_fwd`.
    Deterministic (module docstring)."""
    B, T, D = x.shape
    W = weight.shape[1]
    dev = x.device
    dx = torch.empty(B, T, D, dtype=x.dtype, device=dev)
    dw = torch.empty(D, W, dtype=weight.dtype, device=dev)
    db = torch.empty(D, dtype=bias.dtype, device=dev) if bias is not None else None
    has_halo = halo is not None and W > 1
    if B * T * D == 0 or (halo is not None and not has_halo):
        dhalo = torch.zeros(B, W - 1, D, dtype=halo.dtype, device=dev) if halo is not None \
            else None
    else:  # every slot is written by the kernel
        dhalo = torch.empty(B, W - 1, D, dtype=halo.dtype, device=dev) if has_halo else None
    if B * T * D == 0:
        dw.zero_()
        if db is not None:
            db.zero_()
        return dx, dw, db, dhalo
    # channels-last rows are read in place; a view with strided channels is copied once
    # (coalesced loads of a copy beat strided loads)
    x = x if x.stride(2) == 1 else x.contiguous()
    dy = dy if dy.stride(2) == 1 else dy.contiguous()
    mode, cu, pos, n_cu, steps = doc_source(x, offsets, doc_pos)
    h = halo.contiguous() if has_halo else x
    b = bias.contiguous() if bias is not None else x
    WP = triton.next_power_of_2(W + 1)
    blocks = triton.cdiv(T, CONV_BWD_TOKEN_BLOCK)
    part = torch.empty(B * blocks, WP, D, dtype=torch.float32, device=dev)
    d_blocks = triton.cdiv(D, CONV_BLOCK_D)
    ring = torch.empty(B * blocks * d_blocks * 2 * CONV_BWD_BLOCK_T * CONV_BLOCK_D,
                       dtype=torch.float32, device=dev)
    _CONV1D_BWD_KERNEL[(blocks, d_blocks, B)](
        x, h, weight, b, dy, dx, dhalo if has_halo else dx, part, ring, cu, pos, T, D, n_cu,
        steps,
        *x.stride(), *dy.stride(), *weight.stride(), W=W, WP=WP, ACT=_ACT[activation],
        HAS_BIAS=bias is not None, HAS_HALO=has_halo, MODE=mode, BT=CONV_BWD_BLOCK_T,
        BD=CONV_BLOCK_D, SUB=CONV_BWD_TOKEN_BLOCK // CONV_BWD_BLOCK_T, num_warps=4,
        num_stages=1)
    _CONV1D_PARTIALS_SUM_KERNEL[(triton.cdiv(WP * D, _REDUCE_COLS),)](
        part, dw, db if db is not None else dw, B * blocks, D, *dw.stride(), W=W, WP=WP,
        HAS_BIAS=bias is not None, BR=_REDUCE_ROWS, BM=_REDUCE_COLS, num_warps=4,
        num_stages=1)
    return dx, dw, db, dhalo
