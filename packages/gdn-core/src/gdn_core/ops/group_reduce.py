"""Sum per-value-head partial gradients over each q/k head's group.

``x: [T, HV, D]`` (fp32 partials of ``dq``/``dk``, value head ``hv`` belonging
to q/k head ``hv // group``) → ``[T, H, D]``.

* :func:`group_reduce` — deterministic: one program per (token block, q/k
  head) adds the ``group`` partials in the fixed order ``hv = h·group + 0, 1, …``
  in fp32 and writes the result in the requested dtype. Also the cast for
  ``group == 1``.
* :func:`group_reduce_atomic` — ``tl.atomic_add`` of every partial into an
  fp32 ``[T, H, D]`` accumulator (order of the adds unspecified: not
  bitwise repeatable). For ``deterministic=False`` callers only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["group_reduce", "group_reduce_atomic"]


@triton.jit
def _group_reduce_kernel(
    x,
    out,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = (o_t < T)[:, None] & (o_d < D)[None, :]
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for i_g in range(GROUP):
        p = x + o_t[:, None] * (H * GROUP * D) + (i_h * GROUP + i_g) * D + o_d[None, :]
        acc += tl.load(p, mask=m, other=0.0).to(tl.float32)
    tl.store(out + o_t[:, None] * (H * D) + i_h * D + o_d[None, :],
             acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _group_reduce_atomic_kernel(
    x,
    out,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_hv = tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = (o_t < T)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + o_t[:, None] * (H * GROUP * D) + i_hv * D + o_d[None, :], mask=m,
                  other=0.0).to(tl.float32)
    tl.atomic_add(out + o_t[:, None] * (H * D) + (i_hv // GROUP) * D + o_d[None, :], b_x,
                  mask=m)


_GROUP_REDUCE_ATOMIC_KERNEL = cached_launch(_group_reduce_atomic_kernel)
_GROUP_REDUCE_KERNEL = cached_launch(_group_reduce_kernel)


def _blocks(D: int) -> tuple[int, int]:
    BD = triton.next_power_of_2(D)
    return max(1, 4096 // BD), BD


@launcher(uses_atomics=False, kernels=(_group_reduce_kernel,))
def group_reduce(
    x: torch.Tensor, group: int, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Fixed-order sum of ``x [T, HV, D]`` over groups of ``group`` heads → ``[T, HV/group, D]``."""
    T, HV, D = x.shape
    H = HV // group
    if out is None:
        out = torch.empty(T, H, D, dtype=out_dtype, device=x.device)
    if T == 0:
        return out
    BT, BD = _blocks(D)
    _GROUP_REDUCE_KERNEL[(triton.cdiv(T, BT), H)](
        x, out, T, H=H, D=D, GROUP=group, BT=BT, BD=BD, num_warps=4, num_stages=1
    )
    return out


@launcher(uses_atomics=True, kernels=(_group_reduce_atomic_kernel,))
def group_reduce_atomic(x: torch.Tensor, group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Atomic (non-deterministic order) sum of ``x [T, HV, D]`` over head groups."""
    T, HV, D = x.shape
    H = HV // group
    acc = torch.zeros(T, H, D, dtype=torch.float32, device=x.device)
    if T > 0:
        BT, BD = _blocks(D)
        _GROUP_REDUCE_ATOMIC_KERNEL[(triton.cdiv(T, BT), HV)](
            x, acc, T, H=H, D=D, GROUP=group, BT=BT, BD=BD, num_warps=4, num_stages=1
        )
    return acc if out_dtype == torch.float32 else acc.to(out_dtype)
