"""Fixed-size segments: the deterministic path's unit of parallelism and of context parallelism.

Every document is cut into segments of ``S`` tokens from its start (``S`` a
multiple of the chunk size; the last segment may be short; a document of at
most ``S`` tokens is one segment). A segment is an affine map of the state it
starts from, ``S_out = M S_in + E`` (docs/context-parallel.md), so the forward runs in three
phases:

1. **summaries** — every segment that has a successor gets ``(E, M)`` in one
   launch of :func:`~gdn_core.ops.chunk_state.chunk_state_fwd` over
   segment-level "documents" with the state ``[E | M]`` (``U' = [U | 0]``,
   ``h0 = [0 | I]``, width ``V + K``). ``M`` is skipped where nobody reads it
   (a document's first segment without an initial state);
2. **fold** — per document, in segment order, with the fixed-order IEEE-fp32
   fold of :mod:`gdn_core.kcp.fold` (:func:`~gdn_core.kcp.fold.fold_chain`):
   ``S_in(j+1) = M_j S_in(j) + E_j`` (``S_in(1) = E_0`` without an initial
   state). Each step's bits are :func:`~gdn_core.kcp.fold.fold_step`'s,
   whatever the number of segments or documents folded at once;
3. **main** — every segment's chunk recurrence and output in parallel from its
   entry state: the ordinary kernels with segment-level ``cu_seqlens`` and
   ``initial_state`` = the entry states.

The backward mirrors it: a first reverse pass with zero incoming gradient
gives each segment's own initial-state gradient ``P_j`` (a document's last
segment takes ``dht``), the transposed fold gives ``dS_in(j) = M_jᵀ dS_in(j+1)
+ P_j`` from the last segment down, and the ordinary backward of all segments
runs in parallel with ``dht`` = the next segment's ``dS_in``.

Segments sit on the chunk grid, so the chunk-local stages see the very chunks
of the document-level run, and every segment is an independent set of
programs (Triton) or of torch ops of its own shapes (reference backend): its
bits depend on its inputs only — not on which rank, call or batch of segments
runs it. That is what makes the context-parallel path of a segment plan
(:mod:`gdn_core.kcp.compose`, ``boundary="segment"``) bitwise equal to the
single-rank path for any number of ranks: each rank runs these same functions
on its own segments, with the summaries of the other ranks' segments of its
documents (exchanged) prepended to its fold chains.

A layout in which every document is one segment and nothing continues
(:attr:`SegmentLayout.trivial`) needs no summary, fold or first pass: the
functions here then run exactly the plain chunked path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from gdn_core import reference_phases
from gdn_core.bwd_slabs import Slab, finish_in_slabs, plan_slabs, slab_tokens
from gdn_core.chunking import CHUNK_SIZE, DEFAULT_SEGMENT_SIZE, ChunkIndex
from gdn_core.hostcache import LRUCache, capturing, device_key
from gdn_core.saved import GDNGrads, GDNSaved
from gdn_core.switches import FUSED_FWD_ENV, switch_setting

__all__ = [
    "DEFAULT_SEGMENT_SIZE",
    "FUSED_FWD_ENV",
    "Chains",
    "SegmentBackward",
    "SegmentForward",
    "SegmentLayout",
    "SegmentTables",
    "backward_chains",
    "choose_segment_size",
    "first_document_saved",
    "forward_chains",
    "fused_fwd_wanted",
    "resolve_segment_size",
    "segment_bwd",
    "segment_bwd_begin",
    "segment_bwd_finish",
    "segment_bwd_fold",
    "segment_fwd",
    "segment_fwd_begin",
    "segment_fwd_finish",
    "segment_fwd_fold",
]

#: ``segment_size=None`` in a non-deterministic call segments a layout only where the
#: segments pay, by the two ways they can (:func:`choose_segment_size`). A document of
#: ``L`` tokens walks ``L`` tokens in a row on the plain path, and at most ``2·S`` on the
#: segment path (its summary pass, then its segment). So the chain gets shorter only
#: where some document is longer than this many segments. Otherwise the segments can
#: only give the backward's reverse pass enough programs for the fused state kernel
#: (:func:`gdn_core.ops.backward.fused_state_pays`). H100, det fwd+bwd ms, segments of
#: 4096 against none, the same kernels as ``gdn_train`` (session 29,
#: ``benchmarks/results/2026-12-07-h100-s29-segments.md``):
#: B1 T8192 H16 1.704 vs **1.315** (two segments, 32 programs: the plain path wins);
#: B4 T8192 H16 **2.445** vs 2.610 (128 programs against 64: the fused reverse pass);
#: B1 T32768 H16 **2.784** vs 5.135 (a chain of 8192 tokens against 32768).
CHAIN_SEGMENTS = 2


def resolve_segment_size(segment_size: int | None, chunk_size: int = CHUNK_SIZE) -> int:
    """``None`` → :data:`DEFAULT_SEGMENT_SIZE`; ``0`` → no segmentation (one
    segment per document); else a positive multiple of ``chunk_size``."""
    if segment_size is None:
        return DEFAULT_SEGMENT_SIZE
    if (
        isinstance(segment_size, bool)
        or not isinstance(segment_size, int)
        or segment_size < 0
        or segment_size % chunk_size
    ):
        raise ValueError(
            f"segment_size must be 0 (no segments) or a positive multiple of the chunk size "
            f"{chunk_size}, got {segment_size!r}"
        )
    return segment_size


def choose_segment_size(segment_size: int | None, offsets, HV: int, *, deterministic: bool,
                        chunk_size: int = CHUNK_SIZE) -> int:
    """The segment length a call runs with.

    An explicit ``segment_size`` is validated (:func:`resolve_segment_size`) and
    kept. ``None``: a deterministic call always takes
    :data:`DEFAULT_SEGMENT_SIZE` ``S`` (its bits must not depend on the batch). A
    non-deterministic one takes ``S`` where the segments pay (:data:`CHAIN_SEGMENTS`): some
    document is longer than ``CHAIN_SEGMENTS · S`` tokens (a shorter serial chain), or the
    segments give the reverse pass the programs that the fused state kernel needs while the
    documents alone do not. Otherwise it takes ``0``, the plain path. A layout with no
    document longer than ``S`` is the plain path either way; it keeps ``S``.
    ``offsets``: the host document offsets ``[N+1]``.

    Raises:
        ValueError: for an invalid ``segment_size``.
    """
    S = resolve_segment_size(segment_size, chunk_size)
    if segment_size is not None or deterministic:
        return S
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    longest = max(lengths, default=0)
    if longest <= S or longest > CHAIN_SEGMENTS * S:
        return S
    from gdn_core.ops.backward import fused_state_pays  # the kernels: only where needed

    segments = SegmentLayout.build(offsets, S).num_segments
    if fused_state_pays(segments, HV) and not fused_state_pays(len(lengths), HV):
        return S
    return 0


# ------------------------------------------------------------------ layout --


@dataclass(frozen=True)
class SegmentLayout:
    """The segments of a (rank's) packed token axis — host-side, built once per layout.

    Attributes:
        segment_size: ``S`` (``0``: one segment per document).
        doc_offsets: documents (a rank's fragments) on the flat axis, ``[N+1]``.
        seg_offsets: segment boundaries, ``[nseg+1]``. A zero-length document
            has one zero-length segment.
        doc_segs: ``[N+1]``, the segments of document ``d`` are
            ``doc_segs[d] .. doc_segs[d+1]-1``.
        first_continues: the first document continues one that started on an
            earlier rank (its first segment is not the document's first).
        last_continues: the last document goes on on a later rank.
        has_h0: the documents start from given initial states.
        num_docs, num_segments: the counts (plain attributes, set once).
        trivial: one segment per document and nothing continuing — the plain
            chunked path (no summaries, no fold).
    """

    segment_size: int
    doc_offsets: tuple[int, ...]
    seg_offsets: tuple[int, ...]
    doc_segs: tuple[int, ...]
    first_continues: bool = False
    last_continues: bool = False
    has_h0: bool = False
    num_docs: int = field(init=False)
    num_segments: int = field(init=False)
    trivial: bool = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "num_docs", len(self.doc_offsets) - 1)
        set_(self, "num_segments", len(self.seg_offsets) - 1)
        # one segment per document and nothing continuing: the plain path
        set_(self, "trivial", self.num_segments == self.num_docs and not self.first_continues
             and not self.last_continues)

    @classmethod
    def build(cls, doc_offsets, segment_size: int, *, first_continues: bool = False,
              last_continues: bool = False, has_h0: bool = False) -> SegmentLayout:
        """The layout of ``doc_offsets`` cut into segments of ``segment_size``.

        Cached (a bounded LRU keyed on the offsets, the size and the flags):
        the same arguments give the same object, whose host tables, fold
        chains and per-device tables (:meth:`tables`) are then built once.
        """
        offs = tuple(int(x) for x in doc_offsets)
        key = (offs, int(segment_size), bool(first_continues), bool(last_continues),
               bool(has_h0))
        if (first_continues or last_continues) and len(offs) - 1 == 0:
            raise ValueError("a layout without documents cannot continue across ranks")
        return _LAYOUT_CACHE.get_or_build(key, lambda: cls._make(*key))

    @classmethod
    def _make(cls, offs: tuple[int, ...], S: int, first_continues: bool, last_continues: bool,
              has_h0: bool) -> SegmentLayout:
        seg, doc_segs = [offs[0]], [0]
        for a, b in zip(offs[:-1], offs[1:]):
            if S and b - a > S:
                seg.extend(range(a + S, b, S))
            seg.append(b)
            doc_segs.append(len(seg) - 1)
        return cls(S, offs, tuple(seg), tuple(doc_segs), first_continues, last_continues, has_h0)

    @cached_property
    def seg_doc(self) -> tuple[int, ...]:
        out = []
        for d in range(self.num_docs):
            out.extend([d] * (self.doc_segs[d + 1] - self.doc_segs[d]))
        return tuple(out)

    @cached_property
    def is_first(self) -> tuple[bool, ...]:
        """Segment ``j`` is its document's first (globally: not a continuation)."""
        out = [False] * self.num_segments
        for d in range(self.num_docs):
            if not (d == 0 and self.first_continues):
                out[self.doc_segs[d]] = True
        return tuple(out)

    @cached_property
    def is_last(self) -> tuple[bool, ...]:
        """Segment ``j`` is its document's last (globally)."""
        out = [False] * self.num_segments
        for d in range(self.num_docs):
            if not (d == self.num_docs - 1 and self.last_continues):
                out[self.doc_segs[d + 1] - 1] = True
        return tuple(out)

    @cached_property
    def need_E(self) -> tuple[bool, ...]:
        """Segments whose ``E`` the fold reads (those with a successor)."""
        return tuple(not x for x in self.is_last)

    @cached_property
    def need_M(self) -> tuple[bool, ...]:
        """Segments whose ``M`` a fold reads (forward: a successor and an entry
        state that is not zero; the backward reads a subset)."""
        return tuple(e and (not f or self.has_h0) for e, f in zip(self.need_E, self.is_first))

    @cached_property
    def need_P(self) -> tuple[bool, ...]:
        """Segments whose own initial-state gradient the backward fold reads."""
        return tuple(not f for f in self.is_first)

    @cached_property
    def first_rows(self) -> tuple[int, ...]:
        """``doc_segs[d]`` for every document."""
        return self.doc_segs[:-1]

    @cached_property
    def last_rows(self) -> tuple[int, ...]:
        """The last segment of every document."""
        return tuple(b - 1 for b in self.doc_segs[1:])

    def index(self, device) -> ChunkIndex:
        """The segment-level chunk table (same chunks as the document-level one)."""
        return self.tables(device).index

    @cached_property
    def _memo(self) -> dict:
        """Per-object memo: fold chains by options, device tables by device."""
        return {}

    def tables(self, device) -> SegmentTables:
        """This layout's device tables on ``device`` (:class:`SegmentTables`), built
        once per device with one host→device copy."""
        dev = device_key(device)
        key = ("tables", dev)
        got = self._memo.get(key)
        if got is None:
            got = SegmentTables.build(self, dev)
            if not capturing(dev):
                self._memo[key] = got
        return got

    def _chains(self, kind: str, fn, **opts) -> Chains:
        key = (kind, *sorted(opts.items()))
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = fn(self, **opts)
        return got


@dataclass(frozen=True)
class Chains:
    """Host tables of one :func:`~gdn_core.kcp.fold.fold_chain` call.

    ``rows``: rows of the output buffer (the ``nseg`` per-segment rows first,
    then scratch rows for remote steps); ``extra_row``: the exit state
    (forward) or the first segment's ``dS_in`` (backward), when asked for.
    """

    items: tuple[int, ...]
    prev: tuple[int, ...]
    dst: tuple[int, ...]
    ptr: tuple[int, ...]
    rows: int
    extra_row: int | None = None

    @property
    def empty(self) -> bool:
        return not self.items


_LAYOUT_CACHE = LRUCache()


@dataclass(frozen=True, eq=False)
class SegmentTables:
    """The device tables of one :class:`SegmentLayout` on one device — slices of
    one buffer filled by a single host→device copy (:func:`gdn_core.hostcache.
    pack_tables`), read-only.

    Attributes:
        index: the segment-level :class:`ChunkIndex`.
        fwd_need: int32 ``[nseg]`` summary flags of the forward (bit 0 ``E``,
            bit 1 ``M``), or ``None`` when every segment needs both.
        bwd_need: int32 ``[nseg]`` flags of the backward's first pass
            (``need_P``), or ``None`` when all are needed.
        first_rows / last_rows: int64 ``[N]`` each document's first / last segment.
        h0_docs / h0_rows: int64, the documents that start here (not
            continuing from an earlier rank) and their first segments.
        dht_docs / dht_rows: int64, the documents that end here and their last
            segments.
    """

    index: ChunkIndex
    fwd_need: torch.Tensor | None
    bwd_need: torch.Tensor | None
    first_rows: torch.Tensor
    last_rows: torch.Tensor
    h0_docs: torch.Tensor
    h0_rows: torch.Tensor
    dht_docs: torch.Tensor
    dht_rows: torch.Tensor

    @classmethod
    def build(cls, L: SegmentLayout, device) -> SegmentTables:
        i32, i64 = torch.int32, torch.int64
        want = [int(e) | (int(m) << 1) for e, m in zip(L.need_E, L.need_M)]
        need_P = [int(x) for x in L.need_P]
        N = L.num_docs
        h0_docs = [d for d in range(N) if not (d == 0 and L.first_continues)]
        dht_docs = [d for d in range(N) if not (d == N - 1 and L.last_continues)]
        fwd_all = all(w == 3 for w in want)
        bwd_all = all(need_P)
        index, t = ChunkIndex.build_with(L.seg_offsets, device, CHUNK_SIZE, extra=[
            ([] if fwd_all else want, i32), ([] if bwd_all else need_P, i32),
            (L.first_rows, i64), (L.last_rows, i64),
            (h0_docs, i64), ([L.first_rows[d] for d in h0_docs], i64),
            (dht_docs, i64), ([L.last_rows[d] for d in dht_docs], i64),
        ])
        return cls(index, None if fwd_all else t[0], None if bwd_all else t[1], *t[2:])


def forward_chains(layout: SegmentLayout, *, n_remote: int = 0, seeded_first: bool = False,
                   want_exit: bool = False) -> Chains:
    """Chains of the forward fold. Output row ``j`` = entry state of segment ``j``.

    Pool rows: local segments ``0..nseg-1``, then ``n_remote`` rows of earlier
    ranks' segments of the first document, in document order (its first
    segment first). With ``seeded_first`` row 0 holds the first document's
    entry state instead (the ring). Seed rows (written by the caller): the
    first segment of each document (zero or ``h0``; ignored without ``h0``).
    """
    L = layout
    nseg, N = L.num_segments, L.num_docs
    rows = nseg
    items: list[int] = []
    prev: list[int] = []
    dst: list[int] = []
    ptr = [0]
    extra = None
    for d in range(N):
        a, b = L.doc_segs[d], L.doc_segs[d + 1]
        p = -1
        if d == 0 and L.first_continues:
            if n_remote:
                for i in range(n_remote):
                    if i == n_remote - 1:
                        t = a
                    else:
                        t, rows = rows, rows + 1
                    items.append(nseg + i)
                    prev.append(p)
                    dst.append(t)
                    p = t
            elif seeded_first:
                p = a
            else:
                raise ValueError("the first document continues: give remote summaries or a seed")
        elif L.has_h0:
            p = a
        last_j = b - 1 if (d == N - 1 and L.last_continues and want_exit) else b - 2
        for j in range(a, last_j + 1):
            if j + 1 < b:
                t = j + 1
            else:
                t, rows = rows, rows + 1
                extra = t
            items.append(j)
            prev.append(p)
            dst.append(t)
            p = t
        if len(items) > ptr[-1]:
            ptr.append(len(items))
    return Chains(tuple(items), tuple(prev), tuple(dst), tuple(ptr), rows, extra)


def backward_chains(layout: SegmentLayout, *, n_remote: int = 0, seeded_last: bool = False,
                    want_first: bool = False) -> Chains:
    """Chains of the backward fold. Output row ``j`` = ``D(j) = dS_in(j+1)``,
    the gradient of segment ``j``'s final state.

    Pool rows: local segments, then ``n_remote`` rows of later ranks' segments
    of the last document in reverse document order (its last segment first).
    With ``seeded_last`` row ``nseg-1`` holds that gradient instead (the
    ring). Seed rows (written by the caller): each document's last segment
    (``dht`` or zero). ``want_first``: also the first segment's ``dS_in``.
    """
    L = layout
    nseg, N = L.num_segments, L.num_docs
    rows = nseg
    items: list[int] = []
    prev: list[int] = []
    dst: list[int] = []
    ptr = [0]
    extra = None
    for d in range(N):
        a, b = L.doc_segs[d], L.doc_segs[d + 1]
        p = -1
        if d == N - 1 and L.last_continues:
            if n_remote:
                for i in range(n_remote):
                    if i == n_remote - 1:
                        t = b - 1
                    else:
                        t, rows = rows, rows + 1
                    items.append(nseg + i)
                    prev.append(p)
                    dst.append(t)
                    p = t
            elif seeded_last:
                p = b - 1
            else:
                raise ValueError("the last document continues: give remote summaries or a seed")
        lo = a if (d == 0 and L.first_continues and want_first) else a + 1
        for j in range(b - 1, lo - 1, -1):
            if j - 1 >= a:
                t = j - 1
            else:
                t, rows = rows, rows + 1
                extra = t
            items.append(j)
            prev.append(p)
            dst.append(t)
            p = t
        if len(items) > ptr[-1]:
            ptr.append(len(items))
    return Chains(tuple(items), tuple(prev), tuple(dst), tuple(ptr), rows, extra)


def _run_chains(ch: Chains, pool_E, pool_M, out, transpose: bool) -> None:
    from gdn_core.kcp.fold import fold_chain

    if not ch.empty:
        fold_chain(pool_E, pool_M, out, ch.items, ch.prev, ch.dst, ch.ptr, transpose=transpose)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fwd_rows_covered(L: SegmentLayout, ch: Chains, h0: bool, seeded: bool) -> bool:
    """Whether the forward fold writes every row of its output before any read: the
    seeds (``h0`` rows of the documents that start here; row 0 when ``seeded``) and the
    chains' destinations (host sets, once per layout and options)."""
    key = ("fwd_covered", ch, h0, seeded)
    got = L._memo.get(key)
    if got is None:
        rows = set(ch.dst)
        if h0:
            rows.update(L.first_rows[d] for d in range(L.num_docs)
                        if not (d == 0 and L.first_continues))
        if seeded:
            rows.add(0)
        got = L._memo[key] = rows >= set(range(ch.rows))
    return got


# ----------------------------------------------------------------- forward --


@dataclass(eq=False)
class SegmentForward:
    """A segment forward between its phases (:func:`segment_fwd_begin`,
    :func:`segment_fwd_fold`, :func:`segment_fwd_finish`)."""

    layout: SegmentLayout
    backend: str
    deterministic: bool
    shapes: Any
    scale: float
    l2: bool
    inputs: tuple  # q, k, v, g, beta as given
    initial_state: torch.Tensor | None
    index: ChunkIndex | None = None
    # triton intermediates (flat)
    q_used: torch.Tensor | None = None
    k_used: torch.Tensor | None = None
    q_rstd: torch.Tensor | None = None
    k_rstd: torch.Tensor | None = None
    G: torch.Tensor | None = None
    W: torch.Tensor | None = None
    U: torch.Tensor | None = None
    A_inv: torch.Tensor | None = None  # as the backward reads it (inverse_for_backward)
    v_flat: torch.Tensor | None = None  # v (unit last stride), g, beta flat (saved for backward)
    g_flat: torch.Tensor | None = None
    beta_flat: torch.Tensor | None = None
    summ: torch.Tensor | None = None  # [nseg, HV, K, V+K] = [E | M]
    S_in: torch.Tensor | None = None  # [nseg, HV, K, V] entry states (None: trivial)
    _out: torch.Tensor | None = field(default=None, repr=False)

    @property
    def state_dtype(self) -> torch.dtype:
        return _state_dtype(self.inputs[0].dtype)

    @property
    def device(self) -> torch.device:
        return self.inputs[2].device

    def export_rows(self, a: int, b: int) -> torch.Tensor | None:
        """``[E | M]`` of segments ``a..b-1`` (what a later rank's fold reads)."""
        return None if self.summ is None else self.summ[a:b]


def _as_packed(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def segment_fwd_begin(q, k, v, g, beta, *, layout: SegmentLayout, scale: float,
                      use_qk_l2norm_in_kernel: bool, initial_state: torch.Tensor | None,
                      backend: str, deterministic: bool, shapes, index: ChunkIndex | None = None
                      ) -> SegmentForward:
    """Phase 1: the chunk-local stages and every needed segment summary.

    Inputs as :func:`gdn_core.compose.chunk_gdn_fwd` (validated by the caller);
    ``layout`` over their flat token axis; ``index``: the chunk table of its
    segments on the device (triton backend; ``None``: the layout's own,
    :meth:`SegmentLayout.index`) — for a trivial layout, any table of its
    documents (a :class:`~gdn_core.layout.PaddedChunkIndex` included).
    """
    st = SegmentForward(layout, backend, deterministic, shapes, float(scale),
                        bool(use_qk_l2norm_in_kernel), (q, k, v, g, beta), initial_state)
    L = layout
    s = shapes
    want = any(L.need_E)  # some segment's summary is read (need_M implies need_E)
    if backend == "reference":  # the CPU path
        if want:
            st.summ = reference_phases.summaries(st)
        return st

    from gdn_core.ops import gluon
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.l2norm import l2norm_fwd_pair
    from gdn_core.ops.tiles import unit_last
    from gdn_core.ops.wy import wy_fwd

    if index is None:
        index = L.tables(v.device).index
    st.index = index
    # q/k/v may arrive as views of a packed projection: the L2 norm writes contiguous
    # q/k from them, and the kernels that read v take its strides (unit last).
    qf, kf, vf = q.flatten(0, 1), k.flatten(0, 1), unit_last(v.flatten(0, 1))
    gf, bf = g.flatten(0, 1).contiguous(), beta.flatten(0, 1).contiguous()
    st.v_flat, st.g_flat, st.beta_flat = vf, gf, bf
    if st.l2:
        (st.q_used, st.q_rstd), (st.k_used, st.k_rstd) = l2norm_fwd_pair(qf, kf)  # one launch
    else:
        st.q_used, st.k_used = qf.contiguous(), kf.contiguous()
    st.G = chunk_cumsum_fwd(gf, index)
    # the inverse comes back as the backward reads it (16-bit: rounded in the kernel)
    wy = gluon.pick("wy", wy_fwd, st.k_used, vf, index)
    st.A_inv, st.W, st.U = wy(st.k_used, vf, bf, st.G, index, s.group, A_inv_for_backward=True)
    if want:
        need = L.tables(v.device).fwd_need
        _, _, st.summ = chunk_state_fwd(
            st.k_used, st.W, st.U, st.G, index, s.group, output_final_state=True,
            store_states=False, state_width=s.V + s.K, identity_state=True,
            store_v_new=False, need=need,
        )
    return st


def segment_fwd_fold(st: SegmentForward, *, remote: torch.Tensor | None = None,
                     seed: torch.Tensor | None = None, want_exit: bool = False
                     ) -> torch.Tensor | None:
    """Phase 2: fold the summaries into every segment's entry state (``st.S_in``).

    ``remote``: ``[n, HV, K, V+K]`` summaries ``[E | M]`` of the first
    document's segments held by earlier ranks, in order (all-gather);
    ``seed``: that document's state entering this rank (ring). Returns the
    state leaving the last segment when ``want_exit`` (the ring's send), else
    ``None``.
    """
    L = st.layout
    s = st.shapes
    if L.trivial:
        st.S_in = None
        return None
    n_remote = 0 if remote is None else remote.shape[0]
    ch = L._chains("fwd", forward_chains, n_remote=n_remote, seeded_first=seed is not None,
                   want_exit=want_exit)
    dev, sd = st.device, st.state_dtype
    nseg = L.num_segments
    h0 = st.initial_state
    # every row a seed or a chain step writes needs no zero fill (one launch fewer)
    covered = _fwd_rows_covered(L, ch, h0 is not None, seed is not None)
    out = (torch.empty if covered else torch.zeros)(ch.rows, s.HV, s.K, s.V, dtype=sd,
                                                    device=dev)
    if h0 is not None:
        tabs = L.tables(dev)
        if tabs.h0_docs.numel():
            # h0_docs: every document, or all but a continued first one (a view, no gather)
            out[tabs.h0_rows] = (h0[1:] if L.first_continues else h0).to(sd)
    if seed is not None:
        out[0] = seed.to(sd)
    pool = st.summ
    if remote is not None and n_remote:
        local = pool if pool is not None else remote.new_zeros(nseg, *remote.shape[1:])
        pool = torch.cat([local, remote.to(sd)])
    if pool is not None:
        _run_chains(ch, pool[..., : s.V], pool[..., s.V:], out, transpose=False)
    st._out = out
    st.S_in = out[:nseg]
    return out[ch.extra_row] if (want_exit and ch.extra_row is not None) else None


def fused_fwd_wanted(x: torch.Tensor, K: int, V: int) -> bool:
    """Whether :func:`segment_fwd_finish` runs its last phase as one kernel,
    :func:`gdn_core.ops.chunk_fwd_fused.chunk_fwd_fused` (no ``h`` or ``v_new`` in memory,
    the bits of the two Triton kernels it replaces) for inputs like ``x`` (``[T, H, K]``)
    with value head dim ``V``: on CUDA, where the switch
    :data:`~gdn_core.switches.FUSED_FWD_ENV` is ``1``, or where it is unset and the call
    is one the H200 measured and checked bit for bit (16-bit inputs, K = V = 128: 0.65x
    the two kernels' time on one 32K document, 0.85x on eight). ``0`` keeps the two
    kernels (and the ``state``/``output`` Gluon stages, which the fused kernel replaces).

    Raises:
        ValueError: the variable holds anything but ``""``, ``0`` or ``1``.
    """
    setting = switch_setting(FUSED_FWD_ENV)
    if not x.is_cuda or setting is False:
        return False
    return setting is True or (x.dtype in (torch.bfloat16, torch.float16) and K == V == 128)


def segment_fwd_finish(st: SegmentForward, *, output_final_state: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None, GDNSaved]:
    """Phase 3: every segment's recurrence and output from its entry state.

    Returns ``(o [B,T,HV,V], final [N,HV,K,V] or None, saved)``.
    """
    L, s = st.layout, st.shapes
    init = st.S_in if st.S_in is not None else st.initial_state
    if st.backend == "reference":  # the CPU path
        o, fin, saved = reference_phases.forward(st, init, output_final_state)
    else:
        if fused_fwd_wanted(st.k_used, s.K, s.V):
            from gdn_core.ops import gluon
            from gdn_core.ops.chunk_fwd_fused import chunk_fwd_fused

            fused = gluon.pick("fused_fwd", chunk_fwd_fused, st.q_used, st.k_used, st.W, st.U,
                               st.index)
            o, fin = fused(
                st.q_used, st.k_used, st.W, st.U, st.G, st.scale, st.index, s.group,
                initial_state=init, output_final_state=output_final_state,
            )
            st.W = st.U = None
        else:
            from gdn_core.ops import gluon
            from gdn_core.ops.chunk_state import chunk_state_fwd
            from gdn_core.ops.output import chunk_output_fwd

            state = gluon.pick("state", chunk_state_fwd, st.k_used, st.W, st.U, st.index)
            h, v_new, fin = state(
                st.k_used, st.W, st.U, st.G, st.index, s.group, initial_state=init,
                output_final_state=output_final_state, store_states=True,
            )
            st.W = st.U = None  # spent before the output kernel allocates o
            output = gluon.pick("output", chunk_output_fwd, st.q_used, v_new, h, st.index)
            o = output(st.q_used, st.k_used, v_new, h, st.G, st.scale, st.index, s.group)
        o = o.reshape(s.B, s.T, s.HV, s.V)
        saved = GDNSaved(
            st.deterministic, "triton", s, st.scale, st.l2, st.q_used, st.k_used, st.v_flat,
            st.g_flat, st.beta_flat, st.initial_state, index=st.index, G=st.G,
            q_rstd=st.q_rstd, k_rstd=st.k_rstd, segments=None if L.trivial else L,
            seg_states=st.S_in,
            seg_summ=st.summ, A_inv=st.A_inv,
        )
    final = None
    if output_final_state:
        final = fin if L.trivial else fin[L.tables(fin.device).last_rows]
    return o, final, saved


def segment_fwd(q, k, v, g, beta, *, layout, scale, use_qk_l2norm_in_kernel, initial_state,
                output_final_state, backend, deterministic, shapes, index=None):
    """The single-rank segment forward: the three phases with nothing exchanged."""
    st = segment_fwd_begin(q, k, v, g, beta, layout=layout, scale=scale,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           initial_state=initial_state, backend=backend,
                           deterministic=deterministic, shapes=shapes, index=index)
    segment_fwd_fold(st)
    return segment_fwd_finish(st, output_final_state=output_final_state)


# ---------------------------------------------------------------- backward --


@dataclass(eq=False)
class SegmentBackward:
    """A segment backward between its phases (:func:`segment_bwd_begin`,
    :func:`segment_bwd_fold`, :func:`segment_bwd_finish`)."""

    saved: GDNSaved
    do: torch.Tensor
    dht: torch.Tensor | None
    deterministic: bool
    workspace: Any = None
    P: torch.Tensor | None = None  # [nseg, HV, K, V] own initial-state gradients
    D: torch.Tensor | None = None  # [nseg, HV, K, V] final-state gradients (None: dht)
    D0: torch.Tensor | None = None  # the first pass's dht rows (_doc_last_dht), for the fold
    # triton intermediates
    A_inv: torch.Tensor | None = None
    W: torch.Tensor | None = None
    h: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    dv_local: torch.Tensor | None = None
    do_flat: torch.Tensor | None = None
    slabs: tuple[Slab, ...] | None = None  # the last phase's slabs (gdn_core.bwd_slabs)

    @property
    def layout(self) -> SegmentLayout:
        return self.saved.segments

    @property
    def state_dtype(self) -> torch.dtype:
        return _state_dtype(self.saved.q.dtype)

    def export_rows(self, a: int, b: int) -> torch.Tensor:
        """``[P | M]`` of segments ``a..b-1`` (what an earlier rank's fold reads)."""
        s = self.saved.shapes
        out = torch.zeros(b - a, s.HV, s.K, s.V + s.K, dtype=self.state_dtype,
                          device=self.do.device)
        if self.P is not None:
            out[..., : s.V] = self.P[a:b]
        if self.saved.seg_summ is not None:
            out[..., s.V:] = self.saved.seg_summ[a:b, ..., s.V:]
        return out


def _doc_last_dht(L: SegmentLayout, dht: torch.Tensor | None, rows: int,
                  sd: torch.dtype) -> torch.Tensor | None:
    """``[rows, HV, K, V]`` zeros with ``dht[d]`` in each document's last segment row."""
    if dht is None:
        return None
    out = dht.new_zeros(rows, *dht.shape[1:], dtype=sd)
    tabs = L.tables(out.device)
    if tabs.dht_docs.numel():
        # dht_docs: every document, or all but a continuing last one (a view, no gather)
        out[tabs.dht_rows] = (dht[:-1] if L.last_continues else dht).to(sd)
    return out


def segment_bwd_begin(saved: GDNSaved, do: torch.Tensor, dht: torch.Tensor | None = None, *,
                      deterministic: bool, workspace: Any = None) -> SegmentBackward:
    """Phase 1 of the backward: recompute what the reverse passes need and run
    the first pass (each segment's own initial-state gradient ``P``).

    ``do: [B,T,HV,V]``; ``dht: [N,HV,K,V]`` or ``None`` (checked by the caller).
    """
    L = saved.segments  # None: the plain chunked path (one segment per document)
    bst = SegmentBackward(saved, do, dht, deterministic, workspace)
    s = saved.shapes
    need = L is not None and any(L.need_P)
    init = saved.seg_states if saved.seg_states is not None else saved.initial_state
    if saved.backend == "reference":  # the CPU path
        if need:
            bst.D0 = _doc_last_dht(L, dht, L.num_segments, bst.state_dtype)
            bst.P = reference_phases.entry_state_grads(saved, do, init, bst.D0)
        return bst

    from gdn_core.ops import gluon
    from gdn_core.ops.backward import pick_fused_state, resolve_workspace, uses_dq_partials
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.dv_local import dv_local_bwd
    from gdn_core.ops.wy import wy_apply, wy_fwd

    index = saved.index
    q, k, v, beta, G = saved.q, saved.k, saved.v, saved.beta, saved.G
    T, H, K = k.shape
    group = s.group
    bst.do_flat = do.flatten(0, 1).to(k.dtype).contiguous()
    l2 = saved.use_qk_l2norm_in_kernel and saved.q_rstd is not None  # as segment_bwd_finish
    bst.workspace, ws = resolve_workspace(
        workspace, deterministic=deterministic,
        dq_partials=uses_dq_partials(group, torch.float32 if l2 else None), T=T, H=H,
        HV=s.HV, K=K, V=s.V, num_chunks=index.num_chunks, num_docs=s.num_docs, dtype=k.dtype,
        device=k.device,
    )
    if G is None:
        from gdn_core.ops.cumsum import chunk_cumsum_fwd

        G = chunk_cumsum_fwd(saved.g.contiguous(), index)
        saved.G = G
    if workspace is None:
        bst.slabs = plan_slabs(index, slab_tokens())
    if bst.slabs is not None and not need and saved.A_inv is not None:
        bst.A_inv = saved.A_inv
        return bst  # the last phase recomputes everything slab by slab
    together = None  # W, h and v_new in one launch (U never in memory), where it serves
    if saved.A_inv is not None and bst.slabs is None:
        together = gluon.pick("recompute", None, k, v, saved.A_inv, index)
    if together is not None:
        bst.A_inv = saved.A_inv
        bst.W, bst.h, bst.v_new = together(k, v, beta, G, saved.A_inv, index, group,
                                           initial_state=init)
    else:
        if saved.A_inv is not None:
            bst.A_inv = saved.A_inv
            apply = gluon.pick("wy_apply", wy_apply, k, v, saved.A_inv, index)
            bst.W, U = apply(k, v, beta, G, saved.A_inv, index, group)
        else:
            bst.A_inv, bst.W, U = gluon.pick("wy", wy_fwd, k, v, index)(k, v, beta, G, index,
                                                                         group)
        if bst.slabs is None:
            state = gluon.pick("state", chunk_state_fwd, k, bst.W, U, index)
            bst.h, bst.v_new, _ = state(k, bst.W, U, G, index, group, initial_state=init,
                                        output_final_state=False, store_states=True)
        del U  # spent: v_new holds what the backward needs of it
    if need:
        bst.D0 = _doc_last_dht(L, dht, L.num_segments, bst.state_dtype)  # read, not written
        flags = L.tables(k.device).bwd_need
        # dv_local inside the first pass (pick_fused_state: where it pays), as in the last
        # phase, which then forms it again in its own launch (none is kept in between)
        fused = pick_fused_state(q, bst.W, bst.do_flat, index)
        if fused is not None:
            _, _, bst.P = fused(q, k, bst.W, G, bst.do_flat, bst.D0, saved.scale, index,
                                group, store=False, need=flags)
        else:  # the reverse pass reads dV', which the last phase then takes over
            dv_local = gluon.pick("dv_local", dv_local_bwd, q, bst.do_flat, index)
            bst.dv_local = dv_local(q, k, G, bst.do_flat, saved.scale, index, group,
                                    out=ws["dv_local"])
            state_bwd = gluon.pick("state_bwd", chunk_state_bwd, q, bst.W, bst.do_flat,
                                   bst.dv_local, index)
            _, _, bst.P = state_bwd(q, k, bst.W, G, bst.do_flat, bst.dv_local, bst.D0,
                                    saved.scale, index, group, store=False, need=flags)
    if bst.slabs is not None:  # W and dV' are rebuilt slab by slab in the last phase
        bst.W = bst.dv_local = None
    return bst


def segment_bwd_fold(bst: SegmentBackward, *, remote: torch.Tensor | None = None,
                     seed: torch.Tensor | None = None, want_first: bool = False
                     ) -> torch.Tensor | None:
    """Phase 2: fold ``dS_in(j) = M_jᵀ dS_in(j+1) + P_j`` from each document's
    last segment down, giving every segment's final-state gradient (``bst.D``).

    ``remote``: ``[n, HV, K, V+K]`` rows ``[P | M]`` of the last document's
    segments held by later ranks, last segment first (all-gather); ``seed``:
    the gradient w.r.t. the state leaving this rank's last segment (ring).
    Returns the first segment's ``dS_in`` when ``want_first`` (the ring's
    send), else ``None``.
    """
    saved = bst.saved
    L, s = saved.segments, saved.shapes
    if L is None:  # the plain path: nothing to fold
        bst.D = None
        return None
    n_remote = 0 if remote is None else remote.shape[0]
    ch = L._chains("bwd", backward_chains, n_remote=n_remote, seeded_last=seed is not None,
                   want_first=want_first)
    sd = bst.state_dtype
    dev = bst.do.device
    nseg = L.num_segments
    D0, bst.D0 = bst.D0, None
    if bst.dht is not None and D0 is None:
        D0 = _doc_last_dht(L, bst.dht, nseg, sd)
    if D0 is None:  # no dht: the documents' last rows start from zero
        out = torch.zeros(ch.rows, s.HV, s.K, s.V, dtype=sd, device=dev)
    elif ch.rows == nseg:  # the first pass's dht rows are the seeds (no fill, no copy)
        out = D0
    else:  # rows past nseg are scratch rows of the chains (written before read)
        out = torch.empty(ch.rows, s.HV, s.K, s.V, dtype=sd, device=dev)
        out[:nseg] = D0
    if seed is not None:
        out[nseg - 1] = seed.to(sd)
    if not ch.empty:
        P = bst.P if bst.P is not None else out.new_zeros(nseg, s.HV, s.K, s.V)
        summ = saved.seg_summ
        M = summ[..., s.V:] if summ is not None else out.new_zeros(nseg, s.HV, s.K, s.K)
        if n_remote:
            E_pool = torch.cat([P, remote[..., : s.V].to(sd)])
            M_pool = torch.cat([M, remote[..., s.V:].to(sd)])
        else:
            E_pool, M_pool = P, M
        _run_chains(ch, E_pool, M_pool, out, transpose=True)
    bst.D = out[:nseg]
    bst.P = None  # spent (the fold runs once per backward)
    return out[ch.extra_row] if (want_first and ch.extra_row is not None) else None


def segment_bwd_finish(bst: SegmentBackward) -> GDNGrads:
    """Phase 3: the full backward of every segment with ``dht = D``."""
    saved = bst.saved
    L, s = saved.segments, saved.shapes
    D = bst.D if bst.D is not None else bst.dht
    init = saved.seg_states if saved.seg_states is not None else saved.initial_state
    want_h0 = saved.initial_state is not None
    l2 = saved.use_qk_l2norm_in_kernel and saved.q_rstd is not None
    if saved.backend == "reference":  # the CPU path
        dq, dk, dv, dg, dbeta, dh0 = reference_phases.backward(saved, bst.do, D, init)
    elif bst.slabs is not None:
        dq, dk, dv, dg, dbeta, dh0 = finish_in_slabs(bst, bst.slabs, D, init, l2)
    else:
        from gdn_core.ops.backward import Recomputed, backward_from_recompute

        rec = Recomputed(bst.W, bst.h, bst.v_new)
        dv_local = bst.dv_local
        # the backward frees them as it spends them, and may write results over v_new and
        # dv_local (both recomputed by phase 1, in the workspace's dv_local if there is one)
        bst.W = bst.h = bst.v_new = bst.dv_local = None
        dq, dk, dv, dg, dbeta, dh0 = backward_from_recompute(
            saved.q, saved.k, saved.v, saved.beta, saved.G, bst.A_inv, rec,
            scale=saved.scale, index=saved.index, do=bst.do_flat, dht=D,
            g_dtype=saved.g.dtype, deterministic=bst.deterministic, workspace=bst.workspace,
            dqk_dtype=torch.float32 if l2 else None, dv_local=dv_local, donate=True,
            num_docs=s.num_docs,  # the entry-state gradients may overwrite the fold's fp32 D:
            dh0=bst.D if bst.D is not None and bst.D.dtype == torch.float32 else None,
        )
        del dv_local
        if l2:
            from gdn_core.ops.l2norm import l2norm_bwd_pair

            # one launch for dq and dk; the kernel rounds its fp32 result into the inputs'
            # dtype (no cast launch)
            dq, dk = l2norm_bwd_pair(
                (saved.q, saved.q_rstd, dq, saved.q.new_empty(saved.q.shape)),
                (saved.k, saved.k_rstd, dk, saved.k.new_empty(saved.k.shape)))
    if saved.backend != "reference":  # the kernels' results are on flat tokens
        B, T = s.B, s.T
        dq, dk = dq.reshape(B, T, s.H, s.K), dk.reshape(B, T, s.H, s.K)
        dv = dv.reshape(B, T, s.HV, s.V)
        dg, dbeta = dg.reshape(B, T, s.HV), dbeta.reshape(B, T, s.HV)
    if want_h0:
        # every row a document's first (no document in segments): dh0 itself; else a
        # gather (a view of a few rows would keep the whole buffer alive in h0.grad)
        if L is not None and L.first_rows != tuple(range(dh0.shape[0])):
            dh0 = dh0[L.tables(dh0.device).first_rows]
    else:
        dh0 = None
    return GDNGrads(dq, dk, dv, dg, dbeta, dh0)


def segment_bwd(saved: GDNSaved, do: torch.Tensor, dht: torch.Tensor | None = None, *,
                deterministic: bool, workspace: Any = None) -> GDNGrads:
    """The single-rank segment backward: the three phases with nothing exchanged."""
    bst = segment_bwd_begin(saved, do, dht, deterministic=deterministic, workspace=workspace)
    segment_bwd_fold(bst)
    return segment_bwd_finish(bst)


def first_document_saved(saved: GDNSaved, length: int) -> GDNSaved:
    """The saved set of document 0 alone (its first ``length`` tokens) with the
    same segments, entry states and summaries — for a backward of that
    document with a zero final-state gradient (the KCP ``"chunk"``-policy
    pass-through ranks)."""
    import dataclasses

    L = saved.segments
    n0 = L.doc_segs[1]
    sub = SegmentLayout.build((0, length), L.segment_size, has_h0=saved.initial_state is not None)
    if sub.num_segments != n0:  # pragma: no cover - the same grid by construction
        raise ValueError("first document's segments do not match")
    s = saved.shapes
    shapes = dataclasses.replace(s, B=1, T=length, offsets=(0, length))
    if saved.backend == "reference":
        def cut(x):
            return None if x is None else _as_packed(x)[:, :length]
        index = None
    else:
        def cut(x):
            return None if x is None else x[:length]
        index = sub.index(saved.v.device)
    return dataclasses.replace(
        saved, shapes=shapes, q=cut(saved.q), k=cut(saved.k), v=cut(saved.v), g=cut(saved.g),
        beta=cut(saved.beta), G=cut(saved.G), q_rstd=cut(saved.q_rstd),
        k_rstd=cut(saved.k_rstd),
        initial_state=None if saved.initial_state is None else saved.initial_state[:1],
        index=index, segments=sub, A_inv=None,
        seg_states=None if sub.trivial or saved.seg_states is None else saved.seg_states[:n0],
        seg_summ=None if saved.seg_summ is None else saved.seg_summ[:n0],
    )
