"""Stage 1: within-chunk cumulative sum of the log-decay ``g`` (and its backward).

Chunks of ``C = 64`` tokens restart at every document start (see
:class:`gdn_core.chunking.ChunkIndex`). One program per (chunk, block of value
heads); the scan runs in fp32 inside the program, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import MIN_LOG_DECAY, ChunkIndex
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["chunk_cumsum_fwd", "chunk_cumsum_rev"]


@triton.jit
def _chunk_cumsum_kernel(
    x,
    y,
    chunk_start,
    chunk_len,
    HV,
    BT: tl.constexpr,
    BH: tl.constexpr,
    REVERSE: tl.constexpr,
    FLOOR: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos = tl.load(chunk_start + i_c).to(tl.int64)
    n = tl.load(chunk_len + i_c)
    rt = tl.arange(0, BT)
    rh = i_h * BH + tl.arange(0, BH)
    mask = (rt[:, None] < n) & (rh[None, :] < HV)
    offs = (bos + rt[:, None]) * HV + rh[None, :]
    b = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    if not REVERSE:  # g below FLOOR (-inf: a full reset) reads as FLOOR; NaN stays NaN
        b = tl.where(b < FLOOR, FLOOR, b)
    # masked rows are zero and lie after the valid ones: neither scan direction
    # lets them change a valid row.
    b = tl.cumsum(b, axis=0, reverse=REVERSE)
    tl.store(y + offs, b, mask=mask)


_CHUNK_CUMSUM_KERNEL = cached_launch(_chunk_cumsum_kernel)


def _launch_spec(x: torch.Tensor, index: ChunkIndex, reverse: bool):
    """``(y, grid, args, constexprs)`` of a :func:`_chunk_cumsum_kernel` launch (``grid``
    ``None``: nothing to launch). Each launcher makes the launch itself."""
    if x.dim() != 2:
        raise ValueError(f"expected a [T, HV] tensor, got shape {tuple(x.shape)}")
    T, HV = x.shape
    if T != index.total_tokens:
        raise ValueError(f"tensor has {T} tokens, the chunk index {index.total_tokens}")
    x = x.contiguous()
    y = torch.empty(T, HV, dtype=torch.float32, device=x.device)
    NT = index.num_chunks
    if NT == 0 or HV == 0:
        return y, None, (), {}
    BH = min(triton.next_power_of_2(HV), 16)
    constexprs = dict(BT=index.chunk_size, BH=BH, REVERSE=reverse, FLOOR=MIN_LOG_DECAY,
                      num_warps=2, num_stages=1)
    return y, (NT, triton.cdiv(HV, BH)), (x, y, index.chunk_start, index.chunk_len, HV), \
        constexprs


@launcher(uses_atomics=False, kernels=(_chunk_cumsum_kernel,))
def chunk_cumsum_fwd(g: torch.Tensor, index: ChunkIndex) -> torch.Tensor:
    """Within-chunk inclusive cumulative sum: ``G_t = Σ_{s ≤ t, s in chunk(t)} g_s``.

    A ``g_s`` below :data:`gdn_core.chunking.MIN_LOG_DECAY` (``-inf``: a full reset)
    counts as that value: ``G`` stays finite and every decay across the token is 0.

    Args:
        g: ``[T, HV]`` log-decays, any float dtype (read as fp32).
        index: the chunk table of the token axis.

    Returns:
        ``G: [T, HV]`` fp32.
    """
    G, grid, args, constexprs = _launch_spec(g, index, reverse=False)
    if grid is not None:
        _CHUNK_CUMSUM_KERNEL[grid](*args, **constexprs)
    return G


@launcher(uses_atomics=False, kernels=(_chunk_cumsum_kernel,))
def chunk_cumsum_rev(dG: torch.Tensor, index: ChunkIndex) -> torch.Tensor:
    """Within-chunk reverse inclusive cumulative sum (the backward of :func:`chunk_cumsum_fwd`).

    ``dg_t = Σ_{s ≥ t, s in chunk(t)} dG_s``.

    Args:
        dG: ``[T, HV]`` gradient w.r.t. ``G``, any float dtype (read as fp32).
        index: the chunk table of the token axis.

    Returns:
        ``dg: [T, HV]`` fp32.
    """
    dg, grid, args, constexprs = _launch_spec(dG, index, reverse=True)
    if grid is not None:
        _CHUNK_CUMSUM_KERNEL[grid](*args, **constexprs)
    return dg
