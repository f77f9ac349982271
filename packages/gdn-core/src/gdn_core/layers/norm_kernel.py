"""Triton kernels of the gated RMSNorm (:func:`gdn_core.layers.norm.rms_norm_gated`).

Over rows of ``D`` (one value head of one token): ``n = x · rstd``, ``rstd =
(mean(x²) + eps)^{-1/2}``, ``y = n · w · act(g)`` with ``act`` SiLU or sigmoid
(or 1 without a gate), fp32 inside. One forward kernel (``y``, ``rstd``) and
one backward kernel (``dx``, ``dg``, and per program the partial ``dw`` of its
fixed block of :data:`ROWS_PER_PROGRAM` rows). The partials are added by one
torch ``sum`` over a tensor whose shape depends only on the row count (a
deterministic reduction for a fixed shape), never by atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["ROWS_PER_PROGRAM", "GatedRMSNormFunction", "gated_rms_norm_bwd",
           "gated_rms_norm_fwd"]

#: rows each program handles (a constant: the dw partials' grid is a function of the rows)
ROWS_PER_PROGRAM = 256
_ACTS = {None: 0, "silu": 1, "swish": 1, "sigmoid": 2}


@triton.jit
def _row_block(step, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
               STEPS: tl.constexpr):
    """Rows, row mask, element mask and offsets of this program's ``step``-th block."""
    rr = (tl.program_id(0).to(tl.int64) * STEPS + step) * BR + tl.arange(0, BR)
    rd = tl.arange(0, BD)
    mr = rr < R
    return rr, mr, mr[:, None] & (rd[None, :] < D), rr[:, None] * D + rd[None, :]


@triton.jit
def _gate_offsets(rr, GH, g_row, g_head, BD: tl.constexpr):
    """Offsets of rows ``rr`` in the gate, read at its own strides: row ``r`` is head
    ``r % GH`` of token ``r // GH`` (a view of a packed projection is read in place)."""
    return ((rr // GH) * g_row + (rr % GH) * g_head)[:, None] + tl.arange(0, BD)[None, :]


@triton.jit
def _gated_rms_norm_fwd_kernel(x, g, w, y, rstd, R, GH, g_row, g_head, D: tl.constexpr, eps,
                               ACT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                               STEPS: tl.constexpr):
    rd = tl.arange(0, BD)
    md = rd < D
    b_w = tl.load(w + rd, mask=md, other=0.0).to(tl.float32)
    for step in range(STEPS):
        rr, mr, mask, offs = _row_block(step, R, D, BR, BD, STEPS)
        b_x = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
        b_y = b_x * r[:, None] * b_w[None, :]
        if ACT != 0:
            b_g = tl.load(g + _gate_offsets(rr, GH, g_row, g_head, BD), mask=mask,
                          other=0.0).to(tl.float32)
            s = tl.sigmoid(b_g)
            if ACT == 1:
                b_y = b_y * b_g * s
            else:
                b_y = b_y * s
        tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=mask)
        tl.store(rstd + rr, r, mask=mr)


@triton.jit
def _gated_rms_norm_bwd_kernel(x, g, w, rstd, dy, dx, dg, dw_part, R, GH, g_row, g_head,
                               D: tl.constexpr, ACT: tl.constexpr, BR: tl.constexpr,
                               BD: tl.constexpr, STEPS: tl.constexpr):
    rd = tl.arange(0, BD)
    md = rd < D
    b_w = tl.load(w + rd, mask=md, other=0.0).to(tl.float32)
    acc = tl.zeros([BD], dtype=tl.float32)
    for step in range(STEPS):
        rr, mr, mask, offs = _row_block(step, R, D, BR, BD, STEPS)
        b_x = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd + rr, mask=mr, other=0.0)
        b_n = b_x * r[:, None]
        if ACT != 0:
            b_g = tl.load(g + _gate_offsets(rr, GH, g_row, g_head, BD), mask=mask,
                          other=0.0).to(tl.float32)
            s = tl.sigmoid(b_g)
            if ACT == 1:
                a = b_g * s
                da = s * (1.0 + b_g * (1.0 - s))
            else:
                a = s
                da = s * (1.0 - s)
            tl.store(dg + offs, (b_dy * b_n * b_w[None, :] * da).to(dg.dtype.element_ty),
                     mask=mask)
            b_dy = b_dy * a
        acc += tl.sum(b_dy * b_n, axis=0)
        b_dn = b_dy * b_w[None, :]
        c = tl.sum(b_dn * b_n, axis=1) / D
        tl.store(dx + offs, (r[:, None] * (b_dn - b_n * c[:, None])).to(dx.dtype.element_ty),
                 mask=mask)
    tl.store(dw_part + tl.program_id(0).to(tl.int64) * D + rd, acc, mask=md)


_GATED_RMS_NORM_BWD_KERNEL = cached_launch(_gated_rms_norm_bwd_kernel)
_GATED_RMS_NORM_FWD_KERNEL = cached_launch(_gated_rms_norm_fwd_kernel)


def gate_rows(gate: torch.Tensor) -> torch.Tensor:
    """``gate [..., D]`` as ``[tokens, heads, D]`` with a unit last stride, the shape
    the kernels read at its strides: a view when the leading dimensions allow it
    (a split of a packed projection does), else a contiguous copy."""
    g = gate if gate.stride(-1) == 1 else gate.contiguous()
    g = g.unsqueeze(0) if g.dim() == 1 else g
    g = g.unsqueeze(-2) if g.dim() == 2 else g.flatten(0, -3)
    return g


def _grid(R: int, D: int) -> tuple[int, int, int]:
    BD = triton.next_power_of_2(D)
    BR = max(1, min(ROWS_PER_PROGRAM, 4096 // BD))
    return BR, BD, ROWS_PER_PROGRAM // BR


@launcher(uses_atomics=False, kernels=(_gated_rms_norm_fwd_kernel,))
def gated_rms_norm_fwd(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y like x, rstd [rows] fp32)``; ``x`` contiguous ``[..., D]``, ``gate`` of its
    shape at any strides (:func:`gate_rows`)."""
    D = x.shape[-1]
    R = x.numel() // D if D else 0
    y = torch.empty_like(x)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    if R == 0:
        return y, rstd
    BR, BD, steps = _grid(R, D)
    act = _ACTS[activation] if gate is not None else 0
    gr = gate_rows(gate if gate is not None else x)
    _GATED_RMS_NORM_FWD_KERNEL[(triton.cdiv(R, ROWS_PER_PROGRAM),)](
        x, gr, weight, y, rstd, R, gr.shape[1], gr.stride(0), gr.stride(1), D, eps, ACT=act,
        BR=BR, BD=BD, STEPS=steps, num_warps=4, num_stages=1)
    return y, rstd


@launcher(uses_atomics=False, kernels=(_gated_rms_norm_bwd_kernel,))
def gated_rms_norm_bwd(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor,
                       rstd: torch.Tensor, dy: torch.Tensor, activation: str | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(dx, dgate or None, dweight)``; ``dweight``: the per-program fp32 partials
    summed, in ``weight``'s dtype."""
    D = x.shape[-1]
    R = rstd.numel()
    dx = torch.empty_like(x)
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) \
        if gate is not None else None
    programs = triton.cdiv(R, ROWS_PER_PROGRAM)
    part = torch.zeros(programs, D, dtype=torch.float32, device=x.device)
    if R:
        BR, BD, steps = _grid(R, D)
        act = _ACTS[activation] if gate is not None else 0
        gr = gate_rows(gate if gate is not None else x)
        _GATED_RMS_NORM_BWD_KERNEL[(programs,)](
            x, gr, weight, rstd, dy, dx, dg if dg is not None else dx, part, R, gr.shape[1],
            gr.stride(0), gr.stride(1), D, ACT=act, BR=BR, BD=BD, STEPS=steps,
            num_warps=4, num_stages=1)
    return dx, dg, part.sum(0).to(weight.dtype)


class GatedRMSNormFunction(torch.autograd.Function):
    """Autograd over :func:`gated_rms_norm_fwd` / :func:`gated_rms_norm_bwd`:
    ``apply(x, gate or None, weight, eps, activation)``."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, activation):
        x = x.contiguous()
        y, rstd = gated_rms_norm_fwd(x, gate, weight, eps, activation)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        dx, dg, dw = gated_rms_norm_bwd(x, gate, weight, rstd, dy.contiguous(), ctx.activation)
        return dx, dg, dw, None, None
