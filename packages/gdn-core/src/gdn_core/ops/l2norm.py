"""In-kernel L2 normalisation of q / k over the head dimension, and its backward.

``y = x · rstd`` with ``rstd = (Σ x² + 1e-6)^{-1/2}`` (matches
:func:`gdn_core.reference.l2_normalize`); backward
``dx = rstd · (dy − y (y·dy))``. Row-parallel over the flat ``[T·H]`` rows,
fp32 arithmetic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["l2norm_fwd", "l2norm_bwd", "L2NORM_EPS"]

L2NORM_EPS = 1e-6


@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, R, H, x_row, x_head, D: tl.constexpr, eps, BR: tl.constexpr,
                       BD: tl.constexpr):
    """Rows ``r = t·H + h``: read at ``t·x_row + h·x_head`` (``x``'s strides, unit last),
    written to the contiguous ``y``."""
    rr = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rd = tl.arange(0, BD)
    mr = rr < R
    mask = mr[:, None] & (rd[None, :] < D)
    offs = rr[:, None] * D + rd[None, :]
    x_offs = ((rr // H) * x_row + (rr % H) * x_head)[:, None] + rd[None, :]
    b = tl.load(x + x_offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(b * b, axis=1) + eps)
    tl.store(y + offs, (b * r[:, None]).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rr, r, mask=mr)


@triton.jit
def _l2norm_bwd_kernel(y, rstd, dy, dx, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rr = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rd = tl.arange(0, BD)
    mr = rr < R
    mask = mr[:, None] & (rd[None, :] < D)
    offs = rr[:, None] * D + rd[None, :]
    b_y = tl.load(y + offs, mask=mask, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rstd + rr, mask=mr, other=0.0)
    b_dx = r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, axis=1)[:, None])
    tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=mask)


_L2NORM_BWD_KERNEL = cached_launch(_l2norm_bwd_kernel)
_L2NORM_FWD_KERNEL = cached_launch(_l2norm_fwd_kernel)


def _rows(D: int) -> tuple[int, int]:
    BD = triton.next_power_of_2(D)
    return max(1, min(64, 4096 // BD)), BD


@launcher(uses_atomics=False, kernels=(_l2norm_fwd_kernel,))
def l2norm_fwd(x: torch.Tensor, eps: float = L2NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise the last dimension.

    Args:
        x: ``[T, H, D]`` (any leading shape works), bf16/fp16/fp32. A ``[T, H, D]``
            view with a unit last stride (e.g. q or k split off a packed
            projection) is read in place; anything else is made contiguous first.

    Returns:
        ``(y, rstd)``: ``y`` of ``x``'s shape and dtype, contiguous; ``rstd:
        x.shape[:-1]`` fp32.
    """
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    R = rstd.numel()
    if R == 0 or D == 0:
        return y, rstd
    rows = x if x.dim() == 3 and x.stride(-1) == 1 else x.contiguous().view(-1, 1, D)
    BR, BD = _rows(D)
    _L2NORM_FWD_KERNEL[(triton.cdiv(R, BR),)](
        rows, y, rstd, R, rows.shape[1], rows.stride(0), rows.stride(1), D, eps, BR=BR, BD=BD,
        num_warps=4, num_stages=1
    )
    return y, rstd


@launcher(uses_atomics=False, kernels=(_l2norm_bwd_kernel,))
def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Backward of :func:`l2norm_fwd`: ``dx = rstd · (dy − y (y·dy))``.

    Args:
        y: ``[T, H, D]`` the normalised output of the forward.
        rstd: ``[T, H]`` fp32 from the forward.
        dy: ``[T, H, D]`` gradient w.r.t. ``y``.
        out: ``[T, H, D]`` contiguous buffer for ``dx`` (any float dtype: the kernel
            rounds its fp32 result into it once), or ``None``.

    Returns:
        ``dx: [T, H, D]`` in ``dy``'s dtype, or ``out``.

    Raises:
        ValueError: ``out`` of another shape, or not contiguous.
    """
    y, dy, rstd = y.contiguous(), dy.contiguous(), rstd.contiguous()
    D = y.shape[-1]
    if out is not None and (out.shape != dy.shape or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(dy.shape)} tensor, got "
                         f"{tuple(out.shape)} (contiguous={out.is_contiguous()})")
    dx = torch.empty_like(dy) if out is None else out
    R = rstd.numel()
    if R == 0 or D == 0:
        return dx
    BR, BD = _rows(D)
    _L2NORM_BWD_KERNEL[(triton.cdiv(R, BR),)](
        y, rstd, dy, dx, R, D, BR=BR, BD=BD, num_warps=4, num_stages=1
    )
    return dx
