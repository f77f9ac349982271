"""The last phase of the segment backward in slabs of whole segments: bounded memory.

Once every segment's entry state (the forward fold) and final-state gradient (the
backward fold) are known, the segments are independent: each one's gradients are a
function of its own tokens and those two states. So the backward's last phase (the
recompute of ``W, U, h, v_new``, the local ``dV'``, the reverse pass and the
chunk-local gradients) can run over a few slabs of consecutive segments in turn
instead of over the whole call at once. What the whole-call run holds at its peak —
the recomputed states ``h`` and their gradients ``dh`` (two ``[T, HV, 128]`` 16-bit
tensors' worth each), ``W``, ``U``, ``v_new`` and ``dV'`` — then exists for one slab at a
time; the outputs and the saved tensors are the same.

The bits do not change: every kernel's program computes one chunk or one segment from
that segment's data alone (the state kernels' value-column blocking, which follows the
launch size, does not change bits either), so a slab's launch gives exactly the rows
the whole-call launch gives. ``test_bwd_slabs.py`` checks ``torch.equal`` against the
whole-call backward.

``GDN_CORE_BWD_SLAB_TOKENS=N`` (default 0: off) cuts a call of more than ``N`` tokens
into slabs of at least ``N`` tokens (whole segments; the last slab takes what is
left). It applies where the backward builds its own buffers: with a caller's workspace,
a padded (CUDA-graph) index or the fp32 reference it is ignored. The cost is more,
smaller launches and, where a long document needs the segment fold, the WY apply and
the local ``dV'`` computed twice (once for the fold's first pass, once per slab).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from gdn_core.chunking import ChunkIndex, chunk_index
from gdn_core.switches import env_value

__all__ = ["SLAB_ENV", "Slab", "finish_in_slabs", "plan_slabs", "slab_tokens"]

#: tokens per slab of the backward's last phase (0 or unset: one slab, the whole call)
SLAB_ENV = "GDN_CORE_BWD_SLAB_TOKENS"


def slab_tokens() -> int:
    """:data:`SLAB_ENV` as an int (0 when unset).

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    raw = env_value(SLAB_ENV).strip()
    if not raw:
        return 0
    try:
        tokens = int(raw)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(f"{SLAB_ENV}={raw!r}: expected a non-negative number of tokens")
    return tokens


@dataclass(frozen=True)
class Slab:
    """Tokens ``[t0, t1)`` = units (segments, or documents on the plain path)
    ``[u0, u1)`` of the call's index, and their own index (offsets from 0)."""

    t0: int
    t1: int
    u0: int
    u1: int
    index: ChunkIndex


def plan_slabs(index: ChunkIndex, tokens: int) -> tuple[Slab, ...] | None:
    """Consecutive units of ``index`` grouped into slabs of at least ``tokens`` tokens
    (the last one: the rest), or ``None`` for one slab (``tokens`` 0, a call of at most
    ``tokens`` tokens, a single unit, or a padded index)."""
    if tokens <= 0 or type(index) is not ChunkIndex or index.total_tokens <= tokens:
        return None
    return _plan(index.offsets, tokens, index.chunk_size, index.chunk_start.device)


@functools.lru_cache(maxsize=64)
def _plan(offsets: tuple[int, ...], tokens: int, chunk_size: int,
          device: torch.device) -> tuple[Slab, ...] | None:
    cuts = [0]
    for u in range(1, len(offsets)):
        if offsets[u] - offsets[cuts[-1]] >= tokens and u < len(offsets) - 1:
            cuts.append(u)
    cuts.append(len(offsets) - 1)
    if len(cuts) <= 2:
        return None
    slabs = []
    for u0, u1 in zip(cuts[:-1], cuts[1:]):
        t0, t1 = offsets[u0], offsets[u1]
        sub = chunk_index([o - t0 for o in offsets[u0:u1 + 1]], device, chunk_size)
        slabs.append(Slab(t0, t1, u0, u1, sub))
    return tuple(slabs)


def finish_in_slabs(bst: Any, slabs: tuple[Slab, ...], D: torch.Tensor | None,
                    init: torch.Tensor | None, l2: bool) -> tuple[torch.Tensor, ...]:
    """The segment backward's last phase (:func:`gdn_core.segment.segment_bwd_finish`)
    slab by slab: ``(dq, dk [T,H,K], dv [T,HV,V], dg, dbeta [T,HV], dh0 [units,HV,K,V]
    fp32)`` on flat tokens, ``dq``/``dk`` through the L2-norm backward when ``l2``.

    ``bst``: the :class:`~gdn_core.segment.SegmentBackward` (its saved tensors, the
    forward's 16-bit inverse ``A_inv`` and ``do_flat``); ``D``: each unit's final-state
    gradient or ``None``; ``init``: each unit's entry state or ``None``.
    """
    from gdn_core.ops import gluon
    from gdn_core.ops.backward import Recomputed, backward_from_recompute
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.l2norm import l2norm_bwd_pair
    from gdn_core.ops.wy import wy_apply

    saved = bst.saved
    q, k, v, beta, G, A_inv = saved.q, saved.k, saved.v, saved.beta, saved.G, bst.A_inv
    T, HV = v.shape[0], v.shape[1]
    group = saved.shapes.group
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dg = torch.empty(T, HV, dtype=saved.g.dtype, device=v.device)
    dbeta = torch.empty(T, HV, dtype=beta.dtype, device=v.device)
    # the entry-state gradients overwrite the fold's fp32 D in place where it is one
    reuse = D is not None and D.dtype == torch.float32
    dh0_parts = []
    for s in slabs:
        rows, units = slice(s.t0, s.t1), slice(s.u0, s.u1)
        kj, vj, Gj, Aj = k[rows], v[rows], G[rows], A_inv[rows]
        apply = gluon.pick("wy_apply", wy_apply, kj, vj, Aj, s.index)
        W, U = apply(kj, vj, beta[rows], Gj, Aj, s.index, group)
        rec = Recomputed(W, None, None)
        del W
        state = gluon.pick("state", chunk_state_fwd, kj, rec.W, U, s.index)
        rec.h, rec.v_new, _ = state(
            kj, rec.W, U, Gj, s.index, group,
            initial_state=None if init is None else init[units], output_final_state=False,
            store_states=True,
        )
        del U
        Dj = None if D is None else D[units]
        out = (dq[rows], dk[rows], dv[rows], dg[rows], dbeta[rows])
        dqj, dkj, _, _, _, dh0j = backward_from_recompute(
            q[rows], kj, vj, beta[rows], Gj, Aj, rec, scale=saved.scale, index=s.index,
            do=bst.do_flat[rows], dht=Dj, g_dtype=saved.g.dtype,
            deterministic=bst.deterministic, dqk_dtype=torch.float32 if l2 else None,
            num_docs=s.u1 - s.u0, dh0=Dj if reuse else None, out=out,
        )  # dv, dg, dbeta (and dq, dk where the kernels round them) are in out already
        if l2:  # the fp32 gradients through the normalisation, rounded into the outputs
            l2norm_bwd_pair((q[rows], saved.q_rstd[rows], dqj, out[0]),
                            (kj, saved.k_rstd[rows], dkj, out[1]))
        else:
            for res, buf in zip((dqj, dkj), out[:2], strict=True):
                if res.data_ptr() != buf.data_ptr():
                    buf.copy_(res)  # the group reduction's result
        del dqj, dkj
        dh0_parts.append(dh0j)
    dh0 = D if reuse else torch.cat(dh0_parts)
    return dq, dk, dv, dg, dbeta, dh0
