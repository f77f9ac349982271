"""Block sizes for head dimensions that become ``tl.dot`` operand dimensions.

Triton 3.6's Hopper (wgmma) code is wrong for some narrow dot dimensions in
kernels with several dots. Measured on the H200 (2026-11-30,
``benchmarks/results/2026-11-30-h200-s4-tiles.md``): a 16-wide value block
reads shared memory out of bounds (compute-sanitizer: ``_chunk_output_fwd_kernel``
at V=16, ``_chunk_state_bwd_kernel`` at K=256); a 32-wide one faults in the
small-head suite and gives silently wrong gradients in ``_chunk_state_bwd_kernel``
at K=256 (``dh0`` 81% off, or ``dg`` 3.3% off at 8 warps); 64 is right everywhere
the GPU tests look. So head dimensions are padded (the kernels mask) to at least
:data:`MIN_DOT_TILE`; a kernel may still cap its block at 32 where the GPU tests
validate that shape (the state kernels and the WY backward at K ≤ 128).
"""

from __future__ import annotations

import functools

import torch
import triton

__all__ = ["MIN_DOT_TILE", "dot_tile", "unit_last"]

MIN_DOT_TILE = 64


@functools.lru_cache(maxsize=256)  # every launcher asks on every call (host time, issue 18)
def dot_tile(n: int, cap: int) -> int:
    """Block size for a head dimension ``n``: the next power of two, raised to
    :data:`MIN_DOT_TILE`, then capped at ``cap`` (the kernel's chosen width)."""
    return min(cap, max(MIN_DOT_TILE, triton.next_power_of_2(n)))


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension has unit stride (a kernel that takes the
    other strides reads such a view of a packed projection in place), else a
    contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
