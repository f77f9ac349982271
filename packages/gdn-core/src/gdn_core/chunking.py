"""Document and chunk bookkeeping shared by the references and the kernels.

Everything in this library works on a flat token axis: a fixed-length batch
``[B, T, ...]`` is ``B`` documents of ``T`` tokens laid end to end, a packed
batch ``[1, T, ...]`` with ``cu_seqlens`` is its documents. Chunks of
``CHUNK_SIZE`` tokens restart at every document start, so the last chunk of a
document may be short. The kernels address chunks through a :class:`ChunkIndex`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gdn_core.hostcache import LRUCache, capturing, device_key, pack_tables, tensor_values
from gdn_core.switches import DOC_ORDER_ENV, switch_setting

CHUNK_SIZE = 64

#: Default segment length of the segment algorithm (docs/context-parallel.md), single rank and
#: context parallel alike (the bits depend on it). H200, fwd+bwd wall of the
#: deterministic path, 2026-12-01 (``benchmarks/profile_gdn.py``), S = 1024 / 4096 /
#: no segments: B1 T8192 H16 2.29 / 1.72 / 1.87 ms; B1 T32768 H16 one document
#: 5.45 / 4.99 / 5.31; 8 documents 4.97 / 4.23 / 4.27; B1 T65536 16 documents
#: 9.52 / 8.07 / 7.92. Documents up to 4096 tokens take no summary pass at all.
DEFAULT_SEGMENT_SIZE = 4096

#: The log-decay every kernel reads for a ``g`` below it, ``-inf`` (a full reset) included:
#: any span of the within-chunk cumulative sum ``G`` that holds such a token sums to at
#: most this (every ``g <= 0``), and ``exp`` of it is exactly 0 in fp32 (the smallest
#: subnormal is ``exp(-103.28)``), so the state before the token is forgotten exactly and
#: no ``exp(-inf - (-inf))`` makes a NaN. A finite value: ``G`` keeps ``~1e-5`` absolute
#: precision after one reset in a chunk (``m`` resets in a chunk: ``m * 1e-5``). NaN is
#: kept (it stays in its document).
MIN_LOG_DECAY = -104.0

__all__ = [
    "CHUNK_SIZE",
    "MIN_LOG_DECAY",
    "DEFAULT_SEGMENT_SIZE",
    "ChunkIndex",
    "chunk_host_tables",
    "longest_first",
    "ordered_docs",
    "chunk_index",
    "document_bounds",
    "host_offsets",
    "require_int_entries",
]


def require_int_entries(offsets: Sequence) -> None:
    """Raise ``TypeError`` for an entry of a list ``cu_seqlens`` that is not an int
    (a float such as ``3.7``, or even ``3.0``, would otherwise be truncated
    silently; a bool is not an offset either)."""
    for i, x in enumerate(offsets):
        try:
            if isinstance(x, bool):
                raise TypeError
            operator.index(x)
        except TypeError:
            raise TypeError(f"cu_seqlens entries must be ints, but cu_seqlens[{i}] is "
                            f"{x!r} ({type(x).__name__})") from None


def host_offsets(cu_seqlens: torch.Tensor | list[int] | None, B: int, T: int) -> list[int]:
    """Document offsets ``[0, ..., B*T]`` as Python ints.

    ``cu_seqlens`` given (``B == 1``, validated by the caller) → its values;
    otherwise ``[0, T, 2T, ..., B*T]``. A CUDA ``cu_seqlens`` costs one host
    synchronisation per tensor object (:func:`gdn_core.hostcache.tensor_values`).
    """
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)]
    if isinstance(cu_seqlens, torch.Tensor):
        return list(tensor_values(cu_seqlens))
    return [int(x) for x in cu_seqlens]


def document_bounds(cu_seqlens, B: int, T: int) -> list[tuple[int, int]]:
    """``[(bos, eos), ...]`` per document on the flat token axis."""
    offs = host_offsets(cu_seqlens, B, T)
    return list(zip(offs[:-1], offs[1:]))


@dataclass(frozen=True)
class ChunkIndex:
    """Chunk table of a packed sequence, built on the host once per layout.

    Attributes:
        offsets: document offsets on the flat token axis, host list ``[N+1]``.
        chunk_offsets: index of each document's first chunk, host list ``[N+1]``.
        chunk_doc: ``[NT]`` int32 device tensor, document of each chunk.
        chunk_start: ``[NT]`` int32 device tensor, first token of each chunk.
        chunk_len: ``[NT]`` int32 device tensor, tokens in each chunk (1..C).
        doc_offsets / doc_chunk_offsets: device int32 copies of the host lists.
        doc_order: ``[N]`` int32 device tensor, the documents by chunk count, most
            first (ties in document order; :func:`longest_first`), or ``None``
            (a padded index: the identity). A kernel that walks one document a
            program may read its document from it, so that the longest walks start
            in the first wave and the short ones fill the tail; no bits depend on it.
        num_docs, num_chunks, total_tokens: the counts (``N``, ``NT``, ``T``),
            plain attributes set once at construction (every launcher reads
            them; a property would cost a Python call per read).
    """

    offsets: tuple[int, ...]
    chunk_offsets: tuple[int, ...]
    chunk_size: int
    chunk_doc: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    doc_offsets: torch.Tensor
    doc_chunk_offsets: torch.Tensor
    doc_order: torch.Tensor | None = None
    num_docs: int = field(init=False)
    num_chunks: int = field(init=False)
    total_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_docs", len(self.offsets) - 1)
        object.__setattr__(self, "num_chunks", self._grid_chunks())
        object.__setattr__(self, "total_tokens", self.offsets[-1])

    def _grid_chunks(self) -> int:
        """The chunks the kernels' grids cover (a padded index: its capacity)."""
        return self.chunk_offsets[-1]

    @classmethod
    def build(
        cls, offsets: list[int], device: torch.device | str, chunk_size: int = CHUNK_SIZE
    ) -> ChunkIndex:
        """Build the table from host document offsets (see :func:`host_offsets`).

        The device tables are slices of one buffer filled by a single
        host→device copy. :func:`chunk_index` returns a cached one.
        """
        return cls.build_with(offsets, device, chunk_size)[0]

    @classmethod
    def build_with(
        cls, offsets, device: torch.device | str, chunk_size: int = CHUNK_SIZE,
        extra: Sequence[tuple[Sequence[int], torch.dtype]] = (),
    ) -> tuple[ChunkIndex, list[torch.Tensor]]:
        """:meth:`build`, plus ``extra`` ``(values, dtype)`` tables carried to the
        device in the same single copy (:func:`gdn_core.hostcache.pack_tables`).
        Returns ``(index, extra tensors in order)``."""
        offs = tuple(int(x) for x in offsets)
        chunk_doc, chunk_start, chunk_len, chunk_offsets = chunk_host_tables(offs, chunk_size)
        i32 = torch.int32
        doc, start, length, doc_offs, doc_chunk_offs, order, *rest = pack_tables(
            [(chunk_doc, i32), (chunk_start, i32), (chunk_len, i32), (offs, i32),
             (chunk_offsets, i32), (longest_first(chunk_offsets), i32), *extra], device)
        index = cls(
            offsets=offs,
            chunk_offsets=tuple(chunk_offsets),
            chunk_size=chunk_size,
            chunk_doc=doc,
            chunk_start=start,
            chunk_len=length,
            doc_offsets=doc_offs,
            doc_chunk_offsets=doc_chunk_offs,
            doc_order=order,
        )
        return index, rest


def ordered_docs(index: ChunkIndex) -> torch.Tensor | None:
    """``index.doc_order`` unless ``GDN_CORE_DOC_ORDER=0`` or the index has none (a padded
    index), else ``None``: a launch that walks one document a program then takes its
    documents longest first, from a document-major grid. Every such walk does (the state
    forward, the fused forward, the fused state backward): measured on the H200
    (:data:`gdn_core.switches.DOC_ORDER_ENV`).

    Raises:
        ValueError: ``GDN_CORE_DOC_ORDER`` set to anything but ``0`` or ``1``.
    """
    setting = switch_setting(DOC_ORDER_ENV)
    if index.doc_order is None or setting is False:
        return None
    return index.doc_order


def longest_first(chunk_offsets: Sequence[int]) -> list[int]:
    """The documents of ``chunk_offsets`` (``[N+1]``, each document's first chunk) by chunk
    count, most first; equal counts in document order (a stable sort)."""
    counts = [b - a for a, b in zip(chunk_offsets[:-1], chunk_offsets[1:])]
    return sorted(range(len(counts)), key=lambda n: -counts[n])


def chunk_host_tables(offsets, chunk_size: int = CHUNK_SIZE
                      ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host lists ``(chunk_doc, chunk_start, chunk_len, chunk_offsets)`` of
    :class:`ChunkIndex` for document ``offsets``."""
    chunk_doc: list[int] = []
    chunk_start: list[int] = []
    chunk_len: list[int] = []
    chunk_offsets = [0]
    C = chunk_size
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        if eos > bos:
            cnt = -(-(eos - bos) // C)
            chunk_doc += [n] * cnt
            chunk_start += range(bos, eos, C)
            chunk_len += [C] * (cnt - 1)
            chunk_len.append(eos - bos - (cnt - 1) * C)
        chunk_offsets.append(len(chunk_doc))
    return chunk_doc, chunk_start, chunk_len, chunk_offsets


def chunk_index(offsets, device: torch.device | str, chunk_size: int = CHUNK_SIZE) -> ChunkIndex:
    """The :class:`ChunkIndex` of ``offsets`` on ``device``, from a bounded LRU cache.

    Same layout, device and chunk size → the same object (its device tables
    are read-only). Built by :meth:`ChunkIndex.build` on a miss.
    """
    offs = tuple(int(x) for x in offsets)
    dev = device_key(device)
    return _INDEX_CACHE.get_or_build(
        (offs, dev, int(chunk_size)), lambda: ChunkIndex.build(offs, dev, chunk_size),
        store=not capturing(dev),
    )


_INDEX_CACHE = LRUCache()
