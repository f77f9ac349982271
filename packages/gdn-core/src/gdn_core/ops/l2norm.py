"""In-kernel L2 normalisation of q / k over the head dimension, and its backward.

``y = x · rstd`` with ``rstd = (Σ x² + 1e-6)^{-1/2}`` (matches
:func:`gdn_core.reference.l2_normalize`); backward
``dx = rstd · (dy − y (y·dy))``. Row-parallel over the flat ``[T·H]`` rows,
fp32 arithmetic, no atomics. The ``_pair`` launchers run q's and k's rows in one
launch (grid axis 1 picks the tensor; the same programs, so the same bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["l2norm_fwd", "l2norm_fwd_pair", "l2norm_bwd", "l2norm_bwd_pair", "L2NORM_EPS"]

L2NORM_EPS = 1e-6

_Normed = tuple[torch.Tensor, torch.Tensor]  # (y, rstd)


@triton.jit
def _l2norm_fwd_rows(x, y, rstd, R, H, x_row, x_head, D: tl.constexpr, eps, BR: tl.constexpr,
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
def _l2norm_fwd_kernel(xa, ya, ra, xb, yb, rb, R, H, xa_row, xa_head, xb_row, xb_head,
                       D: tl.constexpr, eps, BR: tl.constexpr, BD: tl.constexpr):
    """One or two tensors of ``R`` rows each in one launch: ``program_id(1)`` 0 normalises
    ``xa``, 1 ``xb`` (the same code: a row's bits do not depend on the pairing)."""
    if tl.program_id(1) == 0:
        _l2norm_fwd_rows(xa, ya, ra, R, H, xa_row, xa_head, D, eps, BR, BD)
    else:
        _l2norm_fwd_rows(xb, yb, rb, R, H, xb_row, xb_head, D, eps, BR, BD)


@triton.jit
def _l2norm_bwd_rows(y, rstd, dy, dx, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
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


@triton.jit
def _l2norm_bwd_kernel(ya, ra, dya, dxa, yb, rb, dyb, dxb, R, D: tl.constexpr,
                       BR: tl.constexpr, BD: tl.constexpr):
    """The backward of one or two tensors in one launch (``program_id(1)``: which)."""
    if tl.program_id(1) == 0:
        _l2norm_bwd_rows(ya, ra, dya, dxa, R, D, BR, BD)
    else:
        _l2norm_bwd_rows(yb, rb, dyb, dxb, R, D, BR, BD)


_L2NORM_BWD_KERNEL = cached_launch(_l2norm_bwd_kernel)
_L2NORM_FWD_KERNEL = cached_launch(_l2norm_fwd_kernel)


def _rows(D: int) -> tuple[int, int]:
    BD = triton.next_power_of_2(D)
    return max(1, min(64, 4096 // BD)), BD


def _fwd_rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[T, H, D]`` rows with a unit last stride (read in place), else a
    contiguous ``[R, 1, D]`` copy."""
    D = x.shape[-1]
    return x if x.dim() == 3 and x.stride(-1) == 1 else x.contiguous().view(-1, 1, D)


def _fwd_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


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
    return _fwd_launch(x, eps=eps)[0]


@launcher(uses_atomics=False, kernels=(_l2norm_fwd_kernel,))
def l2norm_fwd_pair(a: torch.Tensor, b: torch.Tensor, eps: float = L2NORM_EPS
                    ) -> tuple[_Normed, _Normed]:
    """:func:`l2norm_fwd` of ``a`` and of ``b`` (q and k) in one launch, each row's bits
    those of :func:`l2norm_fwd`.

    Args:
        a, b: as :func:`l2norm_fwd`'s ``x``; of one shape and device for the one
            launch (else two launches of :func:`l2norm_fwd`).

    Returns:
        ``((y_a, rstd_a), (y_b, rstd_b))`` as :func:`l2norm_fwd`.
    """
    if a.shape != b.shape or a.device != b.device:
        return l2norm_fwd(a, eps), l2norm_fwd(b, eps)
    return _fwd_launch(a, b, eps=eps)


def _fwd_launch(*xs: torch.Tensor, eps: float) -> tuple[_Normed, ...]:
    """One launch normalising one tensor or two of one shape (grid axis 1 picks the
    tensor; a second one whose rows are laid out otherwise takes its own launch)."""
    outs = [_fwd_outputs(x) for x in xs]
    R, D = outs[0][1].numel(), xs[0].shape[-1]
    if R == 0 or D == 0:
        return tuple(outs)
    rows = [_fwd_rows_view(x) for x in xs]
    if rows[-1].shape != rows[0].shape:  # one read in place, the other copied
        return l2norm_fwd(xs[0], eps), l2norm_fwd(xs[1], eps)
    (xa, (ya, ra)), (xb, (yb, rb)) = (rows[0], outs[0]), (rows[-1], outs[-1])
    BR, BD = _rows(D)
    # pinned: 4 warps, one stage (a row-local reduction; the bits depend on the layout)
    _L2NORM_FWD_KERNEL[(triton.cdiv(R, BR), len(xs))](
        xa, ya, ra, xb, yb, rb, R, xa.shape[1], xa.stride(0), xa.stride(1), xb.stride(0),
        xb.stride(1), D, eps, BR=BR, BD=BD, num_warps=4, num_stages=1
    )
    return tuple(outs)


def _bwd_args(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
              out: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``(y, rstd, dy, dx)`` contiguous, ``dx`` = ``out`` (checked) or fresh."""
    y, dy, rstd = y.contiguous(), dy.contiguous(), rstd.contiguous()
    if out is not None and (out.shape != dy.shape or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(dy.shape)} tensor, got "
                         f"{tuple(out.shape)} (contiguous={out.is_contiguous()})")
    return y, rstd, dy, (torch.empty_like(dy) if out is None else out)


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
    return _bwd_launch((y, rstd, dy, out))[0]


@launcher(uses_atomics=False, kernels=(_l2norm_bwd_kernel,))
def l2norm_bwd_pair(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`l2norm_bwd` of ``a = (y, rstd, dy, out)`` and of ``b`` (q and k) in one
    launch, each row's bits those of :func:`l2norm_bwd`; tensors of two shapes or
    devices take two launches.

    Returns:
        ``(dx_a, dx_b)``.

    Raises:
        ValueError: an ``out`` of another shape, or not contiguous.
    """
    if a[0].shape != b[0].shape or a[0].device != b[0].device:
        return l2norm_bwd(*a), l2norm_bwd(*b)
    return _bwd_launch(a, b)


def _bwd_launch(*cases: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """One launch of the backward of one ``(y, rstd, dy, out)`` or two of one shape
    (grid axis 1 picks which)."""
    args = [_bwd_args(*c) for c in cases]
    (ya, ra, dya, dxa), (yb, rb, dyb, dxb) = args[0], args[-1]
    R, D = ra.numel(), ya.shape[-1]
    if R and D:
        BR, BD = _rows(D)
        # pinned: 4 warps, one stage (a row-local reduction; the bits depend on the layout)
        _L2NORM_BWD_KERNEL[(triton.cdiv(R, BR), len(cases))](
            ya, ra, dya, dxa, yb, rb, dyb, dxb, R, D, BR=BR, BD=BD, num_warps=4, num_stages=1
        )
    return tuple(a[3] for a in args)
