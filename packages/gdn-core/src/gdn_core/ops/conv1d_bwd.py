"""Triton backward of the short causal depthwise conv1d (:mod:`gdn_core.conv1d`).

One program per (fixed block of :data:`CONV_BWD_TOKEN_BLOCK` tokens of a row,
block of ``BD`` channels, row), walking its block in sub-tiles of ``BT``
tokens. For a sub-tile ``t`` it recomputes, for every ``j < W``, the
pre-activation of token ``s = t + j`` and ``g(s) = dy(s) · act'(pre(s))``
(only where ``s`` lies in ``t``'s document: ``start(s) == start(t)``, a select),
then

    dx[t]      = Σ_j g(t + j) · weight[:, W-1-j]
    dweight_i += Σ_t g(t) · x[t - i]      (the taps the forward read)
    dbias     += Σ_t g(t)

so nothing but ``dx`` (and the per-block partials) is written — no stored
activations. The halo gradient (``dhalo [B, W-1, D]``) is the same ``dx`` sum
for the slots ``t = -(W-1) … -1``, done by the programs of the first block.

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
def _dx_tile(x, halo, w0, w1, w2, w3, w4, w5, w6, w7, b_b, dy, i_b, o_t, o_d, m_d, T, D, cu,
             n_cu, steps, pos, sxb, sxt, sxd, syb, syt, syd, W: tl.constexpr,
             ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr,
             MODE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """``(dx [BT, BD], g(t) [BT, BD], start(t), run(t))`` of the tokens ``o_t`` (fp32;
    ``g`` zero outside ``[0, T)``). ``w0 … w7``: the weight's columns (fp32 ``[BD]``,
    loaded once per program); ``b_b``: the bias (fp32 ``[BD]``, read if ``HAS_BIAS``)."""
    st, run = _doc_run(o_t, T, cu, n_cu, steps, pos, W, MODE)
    dx = tl.zeros([BT, BD], dtype=tl.float32)
    g0 = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):  # output token s = t + j; its tap j reads t
        s = o_t + j
        if j == 0:
            same = (s >= 0) & (s < T)
        else:
            same = (s >= 0) & (j <= run)
        if HAS_BIAS:
            pre = tl.zeros([BT, BD], dtype=tl.float32) + b_b[None, :]
        else:
            pre = tl.zeros([BT, BD], dtype=tl.float32)
        for i in tl.static_range(W):  # tap i of s reads t + j - i
            b_x = _tap(x, halo, i_b, o_t, j - i, st, run, o_d, m_d, T, D, sxb, sxt, sxd, W,
                       HAS_HALO)
            pre += b_x * _pick(W - 1 - i, w0, w1, w2, w3, w4, w5, w6, w7)[None, :]
        sc = tl.minimum(tl.maximum(s, 0), T - 1)
        g = tl.load(dy + i_b * syb + sc[:, None] * syt + o_d[None, :] * syd,
                    mask=same[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        if ACT == 1:
            sg = tl.sigmoid(pre)
            g = g * (sg * (1.0 + pre * (1.0 - sg)))
        # a select: a token of another document (whose taps were not all read) adds nothing
        g = tl.where(same[:, None], g, 0.0)
        dx += g * _pick(W - 1 - j, w0, w1, w2, w3, w4, w5, w6, w7)[None, :]
        if j == 0:
            g0 = g
    return dx, g0, st, run


@triton.jit
def _conv1d_bwd_kernel(x, halo, w, bias, dy, dx, dhalo, part, cu, pos, T, D, n_cu, steps,
                       sxb, sxt, sxd, syb, syt, syd, swd, sww, W: tl.constexpr,
                       WP: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_HALO: tl.constexpr, MODE: tl.constexpr, BT: tl.constexpr,
                       BD: tl.constexpr, SUB: tl.constexpr):
    i_k, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
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
    # the sub-tiles holding tokens (the last block of a row may be short)
    for it in range(0, tl.minimum(SUB, tl.cdiv(T - i_k * (SUB * BT), BT))):
        o_t = (i_k.to(tl.int64) * SUB + it) * BT + tl.arange(0, BT)
        m_t = o_t < T
        b_dx, g, st, run = _dx_tile(x, halo, w0, w1, w2, w3, w4, w5, w6, w7, b_b, dy, i_b, o_t,
                                    o_d, m_d, T, D, cu, n_cu, steps, pos, sxb, sxt, sxd, syb,
                                    syt, syd, W, ACT, HAS_BIAS, HAS_HALO, MODE, BT, BD)
        tl.store(dx + (i_b * T + o_t[:, None]) * D + o_d[None, :], b_dx.to(dx.dtype.element_ty),
                 mask=m_t[:, None] & m_d[None, :])
        for i in tl.static_range(W):  # g(t) is zero for t >= T
            gx = g * _tap(x, halo, i_b, o_t, -i, st, run, o_d, m_d, T, D, sxb, sxt, sxd, W,
                          HAS_HALO)
            if i == 0:
                a0 += gx
            elif i == 1:
                a1 += gx
            elif i == 2:
                a2 += gx
            elif i == 3:
                a3 += gx
            elif i == 4:
                a4 += gx
            elif i == 5:
                a5 += gx
            elif i == 6:
                a6 += gx
            else:
                a7 += gx
        if HAS_BIAS:
            ab += g
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
    if HAS_HALO:
        if i_k == 0:  # the halo slots t = -(W-1) .. -1
            o_t = tl.arange(0, BT).to(tl.int64) - BT
            m_h = o_t >= 1 - W
            b_dh, g, st, run = _dx_tile(x, halo, w0, w1, w2, w3, w4, w5, w6, w7, b_b, dy, i_b,
                                        o_t, o_d, m_d, T, D, cu, n_cu, steps, pos, sxb, sxt,
                                        sxd, syb, syt, syd, W, ACT, HAS_BIAS, HAS_HALO, MODE,
                                        BT, BD)
            oh = tl.minimum(tl.maximum(o_t + (W - 1), 0), W - 2)
            tl.store(dhalo + (i_b * (W - 1) + oh[:, None]) * D + o_d[None, :],
                     b_dh.to(dhalo.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])


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
    _conv1d_bwd_kernel[(blocks, triton.cdiv(D, CONV_BLOCK_D), B)](
        x, h, weight, b, dy, dx, dhalo if has_halo else dx, part, cu, pos, T, D, n_cu, steps,
        *x.stride(), *dy.stride(), *weight.stride(), W=W, WP=WP, ACT=_ACT[activation],
        HAS_BIAS=bias is not None, HAS_HALO=has_halo, MODE=mode, BT=CONV_BWD_BLOCK_T,
        BD=CONV_BLOCK_D, SUB=CONV_BWD_TOKEN_BLOCK // CONV_BWD_BLOCK_T, num_warps=4,
        num_stages=1)
    _conv1d_partials_sum_kernel[(triton.cdiv(WP * D, _REDUCE_COLS),)](
        part, dw, db if db is not None else dw, B * blocks, D, *dw.stride(), W=W, WP=WP,
        HAS_BIAS=bias is not None, BR=_REDUCE_ROWS, BM=_REDUCE_COLS, num_warps=4,
        num_stages=1)
    return dx, dw, db, dhalo
