"""Triton forward of the short causal depthwise conv1d (:mod:`gdn_core.conv1d`).

``y[b, t, d] = act(bias[d] + Σ_i weight[d, W-1-i] · x[b, t-i, d])`` with the
taps that would cross a document start read as zeros. One program per
(block of ``BT`` tokens, block of ``BD`` channels, row); fp32 inside, ``y``
in ``x``'s dtype. No cross-program reduction, no atomics.

Where each token's document starts (the only layout fact the taps need) comes
from one of three sources, picked by the constexpr ``MODE``:

* ``0`` — no documents: every row is one sequence (start 0);
* ``1`` — a device copy of ``cu_seqlens``: a branch-free binary search per
  token (``steps = ceil(log2(N + 1))`` gathers from a table of ``N + 1`` ints);
* ``2`` — ``doc_pos`` (each token's position in its document, kept on the
  device by :class:`gdn_core.layout.VarlenLayout`): ``start = t - doc_pos[t]``
  (no host data: a CUDA graph replays it for another layout).

Tap ``i`` of token ``t`` is read when ``t - i >= start(t)``, or when the
document starts at token 0 (``t - i < 0`` then reads the halo, or zeros). A
tap that is not read is a *masked load* (the value is never fetched), so a
NaN or Inf of another document cannot enter — no multiply by a mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["CONV_FWD_BLOCK_T", "CONV_BLOCK_D", "MAX_TRITON_WIDTH", "conv1d_fwd",
           "doc_source"]

#: tokens per forward program
CONV_FWD_BLOCK_T = 64
#: channels per program (forward and backward)
CONV_BLOCK_D = 64
#: widest filter the kernels take (the taps are unrolled); wider ones run the torch path
MAX_TRITON_WIDTH = 8
_ACT = {None: 0, "silu": 1, "swish": 1}


@triton.jit
def _doc_start(t, T, cu, n_cu, steps, pos, MODE: tl.constexpr):
    """First token of the document holding token ``t`` (``[BT]`` int64; tokens
    ``t < 0`` — halo slots — belong to the document at token 0; ``t >= T`` are
    taken as token ``T - 1``)."""
    tc = tl.minimum(tl.maximum(t, 0), T - 1)
    if MODE == 1:
        lo = tl.zeros_like(tc)
        hi = lo + (n_cu - 1)
        for _ in range(steps):
            mid = (lo + hi + 1) // 2
            v = tl.load(cu + mid).to(tl.int64)
            ok = v <= tc
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        start = tl.load(cu + lo).to(tl.int64)
    elif MODE == 2:
        start = tc - tl.load(pos + tc).to(tl.int64)
    else:
        start = tl.zeros_like(tc)
    return start


@triton.jit
def _load_tap(x, halo, i_b, p, ok, o_d, m_d, T, D, sxb, sxt, sxd, W: tl.constexpr,
              HAS_HALO: tl.constexpr):
    """``x[i_b, p, o_d]`` as fp32 ``[BT, BD]`` where ``ok``, reading the halo for
    ``p < 0``; zero (never loaded) elsewhere."""
    in_x = ok & (p >= 0) & (p < T)
    pc = tl.minimum(tl.maximum(p, 0), T - 1)
    v = tl.load(x + i_b * sxb + pc[:, None] * sxt + o_d[None, :] * sxd,
                mask=in_x[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    if HAS_HALO:
        in_h = ok & (p < 0) & (p >= 1 - W)
        ph = tl.minimum(tl.maximum(p + (W - 1), 0), W - 2)
        h = tl.load(halo + (i_b * (W - 1) + ph[:, None]) * D + o_d[None, :],
                    mask=in_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        v = tl.where(in_h[:, None], h, v)
    return v


@triton.jit
def _conv1d_fwd_kernel(x, halo, w, bias, y, cu, pos, T, D, n_cu, steps, sxb, sxt, sxd, swd, sww,
                       W: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_HALO: tl.constexpr, MODE: tl.constexpr, BT: tl.constexpr,
                       BD: tl.constexpr):
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    start = _doc_start(o_t, T, cu, n_cu, steps, pos, MODE)
    first = start == 0
    if HAS_BIAS:
        b_b = tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
        acc = tl.zeros([BT, BD], dtype=tl.float32) + b_b[None, :]
    else:
        acc = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):  # lag i: weight column W-1-i
        p = o_t - i
        ok = m_t & ((p >= start) | first)
        b_x = _load_tap(x, halo, i_b, p, ok, o_d, m_d, T, D, sxb, sxt, sxd, W, HAS_HALO)
        b_w = tl.load(w + o_d * swd + (W - 1 - i) * sww, mask=m_d, other=0.0).to(tl.float32)
        acc += b_x * b_w[None, :]
    if ACT == 1:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + (i_b * T + o_t[:, None]) * D + o_d[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


_CONV1D_FWD_KERNEL = cached_launch(_conv1d_fwd_kernel)


def doc_source(x: torch.Tensor, offsets: list[int] | None, doc_pos: torch.Tensor | None
               ) -> tuple[int, torch.Tensor, torch.Tensor, int, int]:
    """``(MODE, cu table, doc_pos, n_cu, steps)`` for the kernels (see the module
    docstring). ``offsets``: validated host offsets (or ``None``); one document
    needs no table."""
    if doc_pos is not None:
        return 2, doc_pos, doc_pos, 0, 0
    if offsets is None or len(offsets) <= 2:
        return 0, x, x, 0, 0
    from gdn_core.hostcache import device_int_tables

    (cu,) = device_int_tables([offsets], x.device)
    return 1, cu, cu, len(offsets), (len(offsets) - 1).bit_length()


@launcher(uses_atomics=False, kernels=(_conv1d_fwd_kernel,))
def conv1d_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None, offsets: list[int] | None,
               halo: torch.Tensor | None, doc_pos: torch.Tensor | None = None) -> torch.Tensor:
    """The forward on validated inputs → ``y [B, T, D]`` contiguous, ``x``'s dtype.

    ``x [B, T, D]`` any strides (read in place when its channels are contiguous);
    ``weight [D, W]`` any strides (``W <=``
    :data:`MAX_TRITON_WIDTH`); ``bias [D]``; ``halo [B, W-1, D]`` or ``None``;
    ``offsets`` host document offsets (``B == 1``) or ``None``; ``doc_pos``
    ``[T]`` device ints instead of ``offsets``. fp16/bf16/fp32.
    """
    B, T, D = x.shape
    W = weight.shape[1]
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    if B * T * D == 0:
        return y
    x = x if x.stride(2) == 1 else x.contiguous()  # strided channels: one coalescing copy
    mode, cu, pos, n_cu, steps = doc_source(x, offsets, doc_pos)
    has_halo = halo is not None and W > 1
    h = halo.contiguous() if has_halo else x
    b = bias.contiguous() if bias is not None else x
    grid = (triton.cdiv(T, CONV_FWD_BLOCK_T), triton.cdiv(D, CONV_BLOCK_D), B)
    _CONV1D_FWD_KERNEL[grid](
        x, h, weight, b, y, cu, pos, T, D, n_cu, steps, *x.stride(), *weight.stride(),
        W=W, ACT=_ACT[activation], HAS_BIAS=bias is not None, HAS_HALO=has_halo, MODE=mode,
        BT=CONV_FWD_BLOCK_T, BD=CONV_BLOCK_D, num_warps=4, num_stages=1)
    return y
