"""Within-chunk building blocks: the chunk cumulative sum and the decayed Gram.

The per-channel decay cannot be pulled out of a ``q kᵀ`` product the way GDN's
scalar decay can. The product that KDA needs inside a chunk is the *decayed
Gram* matrix ::

    P_ij = Σ_c a_ic b_jc exp(G_ic − G_jc)        for j < i (strict) or j ≤ i

with ``G`` the within-chunk cumulative log decay (non-increasing along the
chunk). The textbook factorisation ``(a ⊙ exp(G)) (b ⊙ exp(−G))ᵀ`` overflows as
soon as a channel decays fast (``g = −5`` per token gives ``exp(+320)`` over a
chunk). Here no exponential of a positive number is ever formed:

* The chunk of ``C = 64`` rows is cut into sub-chunks of ``SUB = 16``. For
  row ``i`` in sub-chunk ``s ≥ 1`` and column ``j`` in an earlier sub-chunk
  the decay is split at the reference row ``r_s = 16 s − 1`` (the last row
  before sub-chunk ``s``): ``exp(G_i − G_j) = exp(G_i − G_r) · exp(G_r − G_j)``,
  both factors ``≤ 1``. Those blocks are then ordinary matrix products.
* Pairs inside one sub-chunk are summed diagonal by diagonal: for each offset
  ``d = i − j`` in ``[0, 16)``, ``exp(G_i − G_{i−d})`` is formed per pair
  (again ``≤ 1``) and contracted over the channels.

Both factors of every product are at most 1 in magnitude times the inputs, so
nothing overflows; an underflow to zero only happens where the true product is
below the float range anyway. All sums run in a fixed order.

The adjoint :func:`decayed_gram_bwd` returns ``(da, db)``. The decay enters
only as differences, so the gradient with respect to ``G`` follows without
extra work: ``dG = a ⊙ da − b ⊙ db``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["SUB_CHUNK", "chunk_cumsum", "decayed_gram", "decayed_gram_bwd"]

SUB_CHUNK = 16


def chunk_cumsum(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Inclusive cumulative sum along dim ``-2`` (forward, or from the end if ``reverse``).

    A log-step (Hillis–Steele) scan of elementwise adds: deterministic on every
    device (``torch.cumsum`` on CUDA is not, and refuses to run under
    ``torch.use_deterministic_algorithms(True)``).
    """
    if reverse:
        x = x.flip(-2)
    n = x.shape[-2]
    shift = 1
    while shift < n:
        x = torch.cat([x[..., :shift, :], x[..., shift:, :] + x[..., :-shift, :]], dim=-2)
        shift *= 2
    if reverse:
        x = x.flip(-2)
    return x


@functools.lru_cache(maxsize=64)
def _far_mask(C: int, device: torch.device) -> torch.Tensor:
    """``[NS−1, C, 1]`` bool: column ``j`` lies before sub-chunk ``s`` (``s = 1..NS−1``)."""
    ns = C // SUB_CHUNK
    s = torch.arange(1, ns).view(-1, 1)
    j = torch.arange(C).view(1, -1)
    return (j < s * SUB_CHUNK).unsqueeze(-1).to(device)


@functools.lru_cache(maxsize=256)
def _near_mask(C: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[C − d]``: 1 where row ``i = d..C−1`` and column ``i − d`` share a sub-chunk."""
    i = torch.arange(d, C)
    return ((i % SUB_CHUNK) >= d).to(dtype).to(device)


def _far_factors(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor):
    """Decay-split operands of the cross-sub-chunk blocks.

    Returns ``ea [..., NS−1, SUB, D]`` (``exp(G_i − G_r)`` for rows of
    sub-chunks 1..NS−1), ``eb [..., NS−1, C, D]`` (``exp(G_r − G_j)`` for
    columns before the sub-chunk, 0 elsewhere) and the scaled operands
    ``a~ = a ⊙ ea``, ``b~ = b ⊙ eb``.
    """
    C = G.shape[-2]
    ns = C // SUB_CHUNK
    G_ref = G[..., SUB_CHUNK - 1 : C - 1 : SUB_CHUNK, :]  # [..., NS−1, D], rows 15, 31, 47
    G_rows = G[..., SUB_CHUNK:, :].unflatten(-2, (ns - 1, SUB_CHUNK))
    ea = torch.exp(G_rows - G_ref.unsqueeze(-2))
    expo = G_ref.unsqueeze(-2) - G.unsqueeze(-3)  # [..., NS−1, C, D]
    eb = torch.exp(expo.masked_fill(~_far_mask(C, G.device), float("-inf")))
    a_t = a[..., SUB_CHUNK:, :].unflatten(-2, (ns - 1, SUB_CHUNK)) * ea
    b_t = b.unsqueeze(-3) * eb
    return ea, eb, a_t, b_t


def _check(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor) -> int:
    C = G.shape[-2]
    if C % SUB_CHUNK or C < SUB_CHUNK:
        raise ValueError(f"chunk size {C} must be a positive multiple of {SUB_CHUNK}")
    if a.shape != G.shape or b.shape != G.shape:
        raise ValueError(f"a, b and G must share a shape, got {a.shape}, {b.shape}, {G.shape}")
    return C


def decayed_gram(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool) -> torch.Tensor:
    """``P_ij = Σ_c a_ic b_jc exp(G_ic − G_jc)`` on ``j < i`` (``strict``) or ``j ≤ i``.

    ``a, b, G: [..., C, D]`` → ``P: [..., C, C]``, zero above the diagonal
    (and on it when ``strict``).
    """
    C = _check(a, b, G)
    _, _, a_t, b_t = _far_factors(a, b, G)
    far = a_t @ b_t.transpose(-1, -2)  # [..., NS−1, SUB, C]
    P = torch.cat([a.new_zeros(*a.shape[:-2], SUB_CHUNK, C), far.flatten(-3, -2)], dim=-2)
    for d in range(1 if strict else 0, SUB_CHUNK):
        e = torch.exp(G[..., d:, :] - G[..., : C - d, :])
        val = (a[..., d:, :] * b[..., : C - d, :] * e).sum(-1)
        P.diagonal(offset=-d, dim1=-2, dim2=-1).add_(val * _near_mask(C, d, val.dtype, val.device))
    return P


def decayed_gram_bwd(
    dP: torch.Tensor, a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adjoint of :func:`decayed_gram` in ``a`` and ``b``.

    Entries of ``dP`` outside the (strictly) lower triangle are ignored.
    Returns ``(da, db)``; the gradient in ``G`` is ``a ⊙ da − b ⊙ db``.
    """
    C = _check(a, b, G)
    ea, eb, a_t, b_t = _far_factors(a, b, G)
    dP_far = dP[..., SUB_CHUNK:, :].unflatten(-2, (C // SUB_CHUNK - 1, SUB_CHUNK))
    da_t = dP_far @ b_t  # [..., NS−1, SUB, D]
    db_t = dP_far.transpose(-1, -2) @ a_t  # [..., NS−1, C, D]
    da_head = a.new_zeros(*a.shape[:-2], SUB_CHUNK, a.shape[-1])  # sub-chunk 0: no far block
    da = torch.cat([da_head, (da_t * ea).flatten(-3, -2)], dim=-2)
    db = (db_t * eb).sum(-3)
    for d in range(1 if strict else 0, SUB_CHUNK):
        e = torch.exp(G[..., d:, :] - G[..., : C - d, :])
        dval = dP.diagonal(offset=-d, dim1=-2, dim2=-1) * _near_mask(C, d, dP.dtype, dP.device)
        w = dval.unsqueeze(-1) * e
        da[..., d:, :] += w * b[..., : C - d, :]
        db[..., : C - d, :] += w * a[..., d:, :]
    return da, db
