"""The grid of a Triton kernel that walks one document (segment) a program.

Such a kernel's programs are ``(value block, document, value head)``: grid
``(V/BV, N, HV)``, head-major (the hardware starts blocks in linear order, the
first grid axis fastest). With a document order (:func:`gdn_core.chunking.ordered_docs`:
the default; ``GDN_CORE_DOC_ORDER=0`` turns it off) the grid is
document-major, ``(V/BV, HV, N)``, and program ``(v, hv, j)`` walks document
``doc_order[j]``: the longest walks start in the first wave. Each program's results
depend on its own document only, so the bits do not depend on the order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["doc_grid", "doc_program"]


def doc_grid(value_blocks: int, num_docs: int, HV: int,
             order: torch.Tensor | None) -> tuple[int, int, int]:
    """The launch grid: ``(value_blocks, num_docs, HV)``, or document-major
    ``(value_blocks, HV, num_docs)`` when ``order`` (the ``doc_order`` table) is given."""
    if order is None:
        return value_blocks, num_docs, HV
    return value_blocks, HV, num_docs


@triton.jit
def doc_program(doc_order, ORDERED: tl.constexpr):
    """``(document, value head)`` of this program on :func:`doc_grid`'s grid (the value
    block is ``tl.program_id(0)`` either way)."""
    if ORDERED:
        return tl.load(doc_order + tl.program_id(2)), tl.program_id(1)
    else:
        return tl.program_id(1), tl.program_id(2)
