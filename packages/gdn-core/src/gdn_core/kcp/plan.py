"""Partition plans for context parallelism (KCP): where the packed sequence is cut.

A plan cuts the global packed token axis ``[0, T)`` into ``world_size``
contiguous shards ``[cuts[r], cuts[r+1])``; rank ``r`` holds shard ``r``. A
document may span any number of ranks and a rank may hold no token at all.
Everything here is pure host-side Python (no tensors, no device): every rank
computes the same plan from the same ``cu_seqlens`` and checks the
:meth:`KCPPlan.digest` across the group.

Boundary policies (where the cuts may fall):

* ``"even"`` — ``cuts[r] = floor(r·T / world_size)``: rank loads differ by at
  most one token; cuts ignore documents and chunks.
* ``"chunk"`` — each cut is a document boundary or a chunk boundary
  (``bos + m·chunk_size``) of the document it splits, the one nearest to the
  ideal ``r·T / world_size`` (ties to the left): every fragment's chunk grid
  is the single-rank grid, and every cut lies within ``chunk_size / 2`` of its
  ideal position (so rank loads are within ``±chunk_size`` of ``T / world``).
* ``"doc"`` — each cut is the document boundary nearest to the ideal position
  if one lies within ``doc_slack · T / world_size`` of it; only otherwise is a
  document split, at the chunk boundary nearest to the ideal position.
* ``"segment"`` — like ``"chunk"`` with ``segment_size`` (a multiple of
  ``chunk_size``) in place of the chunk size: cuts fall on document starts or
  on segment boundaries ``bos + m·segment_size`` (the unit of the planned
  partition-invariant deterministic path, docs/context-parallel.md).

All policies finish with a monotone pass (``cuts[r] = max(cuts[r], cuts[r-1])``),
so shards never overlap even when the sequence is shorter than the world.

Host-side tables (:class:`RankTable`, from :meth:`KCPPlan.rank_table`) give each
rank what the state exchange needs: whether its first fragment continues a
document from an earlier rank, whether its last continues into a later one,
and the chains of ranks whose summaries the forward and backward folds read.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from gdn_core.chunking import CHUNK_SIZE, DEFAULT_SEGMENT_SIZE
from gdn_core.hostcache import tensor_values
from gdn_core.typed import ModeTyped

__all__ = [
    "BOUNDARIES",
    "DEFAULT_DOC_SLACK",
    "DEFAULT_SEGMENT_SIZE",
    "Fragment",
    "KCPPlan",
    "RankTable",
    "normalize_offsets",
    "partition",
]

BOUNDARIES = ("even", "chunk", "doc", "segment")
DEFAULT_DOC_SLACK = 0.125
PLAN_FORMAT = 1


def normalize_offsets(cu_seqlens: torch.Tensor | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Check ``cu_seqlens`` (list, tuple or 1-D int tensor) and return host ints.

    Raises ``TypeError``/``ValueError`` naming ``cu_seqlens``. A CUDA tensor
    costs one host synchronisation per tensor object
    (:func:`gdn_core.hostcache.tensor_values`).
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens has dtype {cu_seqlens.dtype}; expected int32 or int64")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
        offs = list(tensor_values(cu_seqlens))
    elif isinstance(cu_seqlens, (list, tuple)):
        offs = []
        for x in cu_seqlens:
            if isinstance(x, bool) or not isinstance(x, int):
                try:
                    import numpy as np

                    if isinstance(x, np.integer):
                        offs.append(int(x))
                        continue
                except ImportError:  # pragma: no cover
                    pass
                raise TypeError(f"cu_seqlens entries must be ints, got {type(x).__name__}")
            offs.append(int(x))
    else:
        raise TypeError(
            "cu_seqlens must be a list of ints or a 1-D int tensor, got "
            f"{type(cu_seqlens).__name__}"
        )
    if len(offs) < 1 or offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offs[:4]}")
    for i in range(1, len(offs)):
        if offs[i] < offs[i - 1]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}]={offs[i]} < "
                f"cu_seqlens[{i - 1}]={offs[i - 1]}"
            )
    if len(offs) == 1:
        offs.append(0)  # no document: an empty sequence
    return tuple(offs)


@dataclass(frozen=True)
class Fragment:
    """The part of one document that one rank holds.

    Attributes:
        doc: index of the document in the global ``cu_seqlens``.
        doc_start, doc_stop: the document's global token range.
        global_start, global_stop: the fragment's global token range.
        local_start, local_stop: the same range in the rank's shard.
        prev_rank: the nearest earlier rank holding tokens of this document
            (``None``: the document starts here).
        next_rank: the nearest later rank holding tokens of it (``None``: it
            ends here). Ranks in between hold no token.
    """

    doc: int
    doc_start: int
    doc_stop: int
    global_start: int
    global_stop: int
    local_start: int
    local_stop: int
    prev_rank: int | None
    next_rank: int | None

    @property
    def length(self) -> int:
        return self.global_stop - self.global_start

    @property
    def offset_in_doc(self) -> int:
        """Tokens of the document before this fragment (held by earlier ranks)."""
        return self.global_start - self.doc_start

    @property
    def continues_from(self) -> bool:
        """The document started on an earlier rank."""
        return self.prev_rank is not None

    @property
    def continues_into(self) -> bool:
        """The document goes on on a later rank."""
        return self.next_rank is not None


@dataclass(frozen=True)
class RankTable:
    """Host-side exchange metadata of one rank (see the module docstring).

    Attributes:
        rank, world_size, start, stop: the shard.
        local_offsets: the shard's ``cu_seqlens`` (fragments in order; ``(0,)``
            for an empty rank).
        first_continues: the first fragment continues a document from an
            earlier rank (its initial state comes from the fold).
        last_continues: the last fragment continues into a later rank (the
            rank contributes a summary ``(M, S_ext)``).
        passthrough: one fragment that does both (its summary needs ``M``).
        fwd_chain: the ranks, in order, whose summaries fold into this rank's
            initial state: the first is where the document starts (its
            ``S_ext`` seeds the fold), the others are pass-through ranks
            (``S ← M S + S_ext``). Empty when not ``first_continues``.
        bwd_chain: the later ranks, in order, holding the last fragment's
            document: the final-state gradient ``D`` folds from the last of
            them backwards (``D ← Mᵀ D + dS_local``). Empty when not
            ``last_continues``.
    """

    rank: int
    world_size: int
    start: int
    stop: int
    local_offsets: tuple[int, ...]
    first_continues: bool
    last_continues: bool
    passthrough: bool
    fwd_chain: tuple[int, ...]
    bwd_chain: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    @property
    def empty(self) -> bool:
        return self.stop == self.start

    @property
    def num_fragments(self) -> int:
        return len(self.local_offsets) - 1

    @property
    def first_length(self) -> int:
        """Tokens of the first fragment (0 for an empty rank)."""
        return self.local_offsets[1] if self.num_fragments else 0

    @property
    def last_start(self) -> int:
        """Local start of the last fragment."""
        return self.local_offsets[-2] if self.num_fragments else 0


@dataclass(frozen=True)
class KCPPlan(ModeTyped):
    """A partition of a packed sequence over ``world_size`` ranks.

    Build it with :func:`partition` (or a package's ``partition_*_kcp``); the
    training packages subclass it to type it per mode (``deterministic``).
    """

    offsets: tuple[int, ...]
    world_size: int
    chunk_size: int
    boundary: str
    cuts: tuple[int, ...]
    segment_size: int | None = None
    doc_slack: float | None = None
    _fragments: tuple[tuple[Fragment, ...], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.cuts) != self.world_size + 1:
            raise ValueError("cuts must hold world_size + 1 entries")
        object.__setattr__(self, "_fragments", _build_fragments(self.offsets, self.cuts))

    # ------------------------------------------------------------ queries --

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    def token_range(self, rank: int) -> tuple[int, int]:
        """``(start, stop)``: rank ``rank``'s shard of the global token axis."""
        r = self._check_rank(rank)
        return self.cuts[r], self.cuts[r + 1]

    def num_tokens(self, rank: int) -> int:
        start, stop = self.token_range(rank)
        return stop - start

    def fragments(self, rank: int) -> tuple[Fragment, ...]:
        """The document fragments rank ``rank`` holds, in token order."""
        return self._fragments[self._check_rank(rank)]

    def local_offsets(self, rank: int) -> tuple[int, ...]:
        """The shard's ``cu_seqlens`` (``(0,)`` for an empty rank)."""
        frags = self.fragments(rank)
        return (0,) + tuple(f.local_stop for f in frags)

    def rank_table(self, rank: int) -> RankTable:
        """Host-side exchange metadata of rank ``rank`` (:class:`RankTable`)."""
        r = self._check_rank(rank)
        frags = self._fragments[r]
        start, stop = self.cuts[r], self.cuts[r + 1]
        if not frags:
            return RankTable(r, self.world_size, start, stop, (0,), False, False, False, (), ())
        first, last = frags[0], frags[-1]
        fwd: list[int] = []
        if first.continues_from:
            # walk back to where the document starts: every rank on the way
            # with tokens holds a pass-through fragment of it.
            p = first.prev_rank
            while p is not None:
                fwd.append(p)
                p = self._fragments[p][-1].prev_rank
            fwd.reverse()
        bwd: list[int] = []
        if last.continues_into:
            n = last.next_rank
            while n is not None:
                bwd.append(n)
                n = self._fragments[n][0].next_rank
        return RankTable(
            rank=r,
            world_size=self.world_size,
            start=start,
            stop=stop,
            local_offsets=self.local_offsets(r),
            first_continues=first.continues_from,
            last_continues=last.continues_into,
            passthrough=len(frags) == 1 and first.continues_from and first.continues_into,
            fwd_chain=tuple(fwd),
            bwd_chain=tuple(bwd),
        )

    def max_tokens(self) -> int:
        """The largest shard (a cap for per-rank buffers)."""
        return max(self.cuts[r + 1] - self.cuts[r] for r in range(self.world_size))

    # ----------------------------------------------------------- segments --

    def fragment_segments(self, fragment: Fragment) -> int:
        """Segments of ``fragment`` (``"segment"`` plans: it starts on its
        document's segment grid, so these are the document's own segments)."""
        S = self.segment_size
        if not S:
            raise ValueError("fragment_segments needs a plan with boundary='segment'")
        return max(1, -(-fragment.length // S))

    def segment_slots(self) -> int:
        """Rows per rank of the segment-summary exchange of a ``"segment"`` plan.

        Every rank contributes this many ``[HV, K, V+K]`` rows (the summaries
        of its first or last fragment's segments, identity/zero-padded), so the
        exchanged shapes depend only on the total length, the world size and
        the segment size: ``ceil(T / (world·S)) + 1`` (a shard is at most
        ``T/world + S`` tokens long, every cut lying within ``S/2`` of its
        balanced position), or more if some fragment needs it.
        """
        S = self.segment_size
        if not S:
            raise ValueError("segment_slots needs a plan with boundary='segment'")
        cap = -(-self.total_tokens // (self.world_size * S)) + 1
        for frags in self._fragments:
            for f in (frags[:1] + frags[-1:]):
                cap = max(cap, self.fragment_segments(f))
        return cap

    # ------------------------------------------------------------- digest --

    def describe(self) -> dict:
        """The canonical description the digest hashes (JSON-serialisable)."""
        return {
            "format": PLAN_FORMAT,
            "kind": type(self).__qualname__,
            "deterministic": self.deterministic,
            "offsets": list(self.offsets),
            "world_size": self.world_size,
            "chunk_size": self.chunk_size,
            "boundary": self.boundary,
            "segment_size": self.segment_size,
            "doc_slack": None if self.doc_slack is None else repr(float(self.doc_slack)),
            "cuts": list(self.cuts),
        }

    def digest(self) -> str:
        """SHA-256 (hex) of :meth:`describe`: equal on every rank of one plan."""
        text = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def digest_words(self) -> list[int]:
        """The digest as four signed 64-bit ints (for an int64 all-gather)."""
        raw = bytes.fromhex(self.digest())
        return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _build_fragments(
    offsets: tuple[int, ...], cuts: tuple[int, ...]
) -> tuple[tuple[Fragment, ...], ...]:
    W = len(cuts) - 1
    docs = [(n, a, b) for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])) if b > a]
    # per rank: (doc, doc_start, doc_stop, gstart, gstop)
    raw: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(W)]
    di = 0
    for r in range(W):
        start, stop = cuts[r], cuts[r + 1]
        if stop == start:
            continue
        while di < len(docs) and docs[di][2] <= start:
            di += 1
        j = di
        while j < len(docs) and docs[j][1] < stop:
            n, a, b = docs[j]
            raw[r].append((n, a, b, max(a, start), min(b, stop)))
            j += 1
    # prev/next rank holding the same document
    last_rank_of_doc: dict[int, int] = {}
    prev: list[list[int | None]] = [[None] * len(raw[r]) for r in range(W)]
    for r in range(W):
        for i, (n, *_rest) in enumerate(raw[r]):
            prev[r][i] = last_rank_of_doc.get(n)
            last_rank_of_doc[n] = r
    nxt: list[list[int | None]] = [[None] * len(raw[r]) for r in range(W)]
    first_rank_after: dict[int, int] = {}
    for r in reversed(range(W)):
        for i, (n, *_rest) in enumerate(raw[r]):
            nxt[r][i] = first_rank_after.get(n)
            first_rank_after[n] = r
    out = []
    for r in range(W):
        start = cuts[r]
        frags = tuple(
            Fragment(n, a, b, gs, ge, gs - start, ge - start, prev[r][i], nxt[r][i])
            for i, (n, a, b, gs, ge) in enumerate(raw[r])
        )
        out.append(frags)
    return tuple(out)


# ----------------------------------------------------------------- cutting --


def _grid_candidates(offsets: tuple[int, ...], step: int) -> list[int]:
    """Sorted positions ``bos + m·step`` of every document, plus every document boundary."""
    cand = set(offsets)
    for a, b in zip(offsets[:-1], offsets[1:]):
        cand.update(range(a, b, step))
    return sorted(cand)


def _nearest(cands: list[int], target: Fraction) -> int:
    """The candidate nearest to ``target`` (ties to the smaller one)."""
    i = bisect.bisect_left(cands, target)
    best = None
    for j in (i - 1, i):
        if 0 <= j < len(cands):
            c = cands[j]
            if best is None or abs(c - target) < abs(best - target):
                best = c
    assert best is not None
    return best


def _doc_of(offsets: tuple[int, ...], pos: Fraction) -> tuple[int, int]:
    """``(bos, eos)`` of the non-empty document whose interior holds ``pos``."""
    i = bisect.bisect_right(offsets, pos) - 1
    i = min(max(i, 0), len(offsets) - 2)
    return offsets[i], offsets[i + 1]


def _cuts(
    offsets: tuple[int, ...],
    world_size: int,
    chunk_size: int,
    boundary: str,
    segment_size: int | None,
    doc_slack: float,
) -> tuple[int, ...]:
    T = offsets[-1]
    W = world_size
    targets = [Fraction(r * T, W) for r in range(W + 1)]
    if boundary == "even":
        cuts = [(r * T) // W for r in range(W + 1)]
    elif boundary in ("chunk", "segment"):
        step = chunk_size if boundary == "chunk" else segment_size
        cands = _grid_candidates(offsets, step)
        cuts = [_nearest(cands, t) for t in targets]
    elif boundary == "doc":
        bounds = sorted(set(offsets))
        slack = Fraction(doc_slack).limit_denominator(1 << 20) * Fraction(T, W)
        cuts = []
        for t in targets:
            b = _nearest(bounds, t)
            if abs(b - t) <= slack:
                cuts.append(b)
                continue
            bos, eos = _doc_of(offsets, t)
            cands = sorted(set(range(bos, eos, chunk_size)) | {eos})
            cuts.append(_nearest(cands, t))
    else:  # pragma: no cover - validated by the caller
        raise ValueError(boundary)
    cuts[0], cuts[-1] = 0, T
    for r in range(1, W + 1):
        cuts[r] = max(cuts[r], cuts[r - 1])
    return tuple(int(c) for c in cuts)


def partition(
    cu_seqlens: torch.Tensor | list[int] | tuple[int, ...],
    world_size: int,
    *,
    chunk_size: int = CHUNK_SIZE,
    boundary: str = "chunk",
    segment_size: int | None = None,
    doc_slack: float = DEFAULT_DOC_SLACK,
    plan_cls: type[KCPPlan] = KCPPlan,
) -> KCPPlan:
    """Cut the packed sequence described by ``cu_seqlens`` over ``world_size`` ranks.

    Pure CPU and deterministic. ``boundary``: one of :data:`BOUNDARIES` (see
    the module docstring); ``segment_size`` only with ``"segment"`` (default
    :data:`DEFAULT_SEGMENT_SIZE`, a multiple of ``chunk_size``); ``doc_slack``
    only matters for ``"doc"``. Any ``world_size >= 1`` and any total length
    ``>= 0`` work: ranks may receive no tokens.

    Raises ``TypeError``/``ValueError`` for bad arguments.
    """
    offsets = normalize_offsets(cu_seqlens)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if boundary not in BOUNDARIES:
        raise ValueError(f"boundary must be one of {BOUNDARIES}, got {boundary!r}")
    if boundary == "segment":
        if segment_size is None:
            segment_size = max(DEFAULT_SEGMENT_SIZE // chunk_size, 1) * chunk_size
        if (
            isinstance(segment_size, bool)
            or not isinstance(segment_size, int)
            or segment_size < chunk_size
            or segment_size % chunk_size
        ):
            raise ValueError(
                f"segment_size must be a positive multiple of chunk_size={chunk_size}, "
                f"got {segment_size!r}"
            )
    elif segment_size is not None:
        raise ValueError(f"segment_size is only used with boundary='segment', got {boundary!r}")
    if not (isinstance(doc_slack, (int, float)) and 0 <= doc_slack <= 0.5):
        raise ValueError(f"doc_slack must be a number in [0, 0.5], got {doc_slack!r}")
    cuts = _cuts(offsets, world_size, chunk_size, boundary, segment_size, float(doc_slack))
    return plan_cls(
        offsets=offsets,
        world_size=world_size,
        chunk_size=chunk_size,
        boundary=boundary,
        cuts=cuts,
        segment_size=segment_size,
        doc_slack=float(doc_slack) if boundary == "doc" else None,
    )
