"""Block sizes for head dimensions that become ``tl.dot`` operand dimensions."""

from __future__ import annotations

import triton

__all__ = ["MIN_DOT_TILE", "dot_tile"]

#: The smallest block any kernel uses for a K or V extent. Triton 3.6's Hopper
#: (wgmma) code reads shared memory out of bounds when a dot has a 16-wide
#: operand dimension beside other dots: compute-sanitizer on the H200
#: (2026-11-30) caught ``_chunk_output_fwd_kernel`` at V=16 and
#: ``_chunk_state_bwd_kernel`` at K=256 with BV=16, both ending in an illegal
#: address. Smaller heads are padded up to 32 by the kernels' masks instead.
MIN_DOT_TILE = 32


def dot_tile(n: int, cap: int | None = None) -> int:
    """Block size covering ``n`` (a head dimension): the next power of two, at most
    ``cap`` (when given), never below :data:`MIN_DOT_TILE`."""
    tile = triton.next_power_of_2(n)
    if cap is not None:
        tile = min(tile, cap)
    return max(tile, MIN_DOT_TILE)
