"""Document layouts with fixed-size device tables: compiled and CUDA-graph training.

A :class:`VarlenLayout` describes the documents of a packed batch
(``cu_seqlens``) for the custom ops of the training packages. It carries

* the host offsets (so no forward or backward reads a device tensor on the
  host), and
* device tables whose **shapes depend only on its capacities** — ``T`` tokens,
  ``max_docs`` documents, ``max_chunks`` chunks — not on the layout: the
  padded ``cu_seqlens`` (``[max_docs + 1]`` int32, trailing empty documents at
  ``T``), the chunk index (:class:`PaddedChunkIndex`: ``max_chunks`` chunks,
  the unused ones of length 0 belonging to no document) and each token's
  position in its document (``doc_pos``, for the causal conv's masks).

The kernels are launched over the capacities (empty documents and empty chunks
do nothing), so a step captured in a CUDA graph with one layout replays for
another after :meth:`VarlenLayout.update` copied the new tables into the same
buffers. Since the padded documents are part of the problem, a call with a
layout sees ``max_docs`` documents: ``initial_state`` and the final state are
``[max_docs, HV, K, V]`` (the padded documents' final state is their initial
state, or zeros).

A layout runs the plain chunked recurrence, without the segments of
:mod:`gdn_core.segment` (``segment_size=0``: their tables would follow the
layout); with documents longer than a segment the bits are those of
``segment_size=0``, not of the default.

Pass a layout as ``cu_seqlens=`` to the packages' differentiable calls. Under
``torch.compile`` a new layout object of the same capacities does not
recompile (it enters the graph as tensors: its handle and its padded
``cu_seqlens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gdn_core.chunking import CHUNK_SIZE, ChunkIndex
from gdn_core.custom_ops import register_handle
from gdn_core.devices import require_device
from gdn_core.hostcache import tensor_values

__all__ = ["PaddedChunkIndex", "VarlenLayout", "layout_tables"]


@dataclass(frozen=True)
class PaddedChunkIndex(ChunkIndex):
    """A :class:`~gdn_core.chunking.ChunkIndex` whose device tables hold ``chunk_capacity``
    chunks: ``num_chunks`` (the kernels' grid) is the capacity; the chunks after
    the real ones have length 0, start at the end of the token axis and belong
    to no document (``doc_chunk_offsets`` stops at the real count)."""

    chunk_capacity: int = 0

    def _grid_chunks(self) -> int:
        return self.chunk_capacity

    @property
    def num_real_chunks(self) -> int:
        return self.chunk_offsets[-1]


def _host_offsets(cu_seqlens) -> tuple[int, ...]:
    if isinstance(cu_seqlens, VarlenLayout):
        return cu_seqlens.offsets
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens has dtype {cu_seqlens.dtype}; expected int32 or int64")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
        return tensor_values(cu_seqlens)  # a CUDA tensor: one sync per tensor object
    if isinstance(cu_seqlens, (list, tuple)):
        out = []
        for x in cu_seqlens:
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"cu_seqlens entries must be ints, got {type(x).__name__}")
            out.append(int(x))
        return tuple(out)
    raise TypeError(
        f"cu_seqlens must be a list of ints or a 1-D int tensor, got {type(cu_seqlens).__name__}"
    )


def _check_offsets(offs: tuple[int, ...]) -> None:
    if len(offs) < 2 or offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least 2 entries, got {offs[:4]}")
    for i in range(1, len(offs)):
        if offs[i] < offs[i - 1]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}]={offs[i]} < "
                f"cu_seqlens[{i - 1}]={offs[i - 1]}"
            )


def _num_chunks(offs: tuple[int, ...], chunk_size: int) -> int:
    return sum(-(-(b - a) // chunk_size) for a, b in zip(offs[:-1], offs[1:]))


def layout_tables(offsets: tuple[int, ...], max_docs: int, max_chunks: int,
                  chunk_size: int = CHUNK_SIZE) -> dict[str, list[int]]:
    """Host tables of a padded layout (see the module docstring): ``cu_seqlens``
    ``[max_docs+1]``, ``chunk_offsets`` ``[max_docs+1]``, ``chunk_doc``,
    ``chunk_start``, ``chunk_len`` ``[max_chunks]``, ``doc_pos`` ``[T]``."""
    T = offsets[-1]
    N = len(offsets) - 1
    cu = list(offsets) + [T] * (max_docs - N)
    chunk_doc, chunk_start, chunk_len, chunk_offsets = [], [], [], [0]
    doc_pos: list[int] = []
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        for start in range(bos, eos, chunk_size):
            chunk_doc.append(n)
            chunk_start.append(start)
            chunk_len.append(min(chunk_size, eos - start))
        chunk_offsets.append(len(chunk_doc))
        doc_pos.extend(range(eos - bos))
    real = len(chunk_doc)
    chunk_offsets += [real] * (max_docs - N)
    pad = max_chunks - real
    chunk_doc += [max(N - 1, 0)] * pad
    chunk_start += [T] * pad
    chunk_len += [0] * pad
    return {"cu_seqlens": cu, "chunk_offsets": chunk_offsets, "chunk_doc": chunk_doc,
            "chunk_start": chunk_start, "chunk_len": chunk_len, "doc_pos": doc_pos}


class VarlenLayout:
    """The documents of a packed batch with fixed-size device tables (module docstring).

    Args:
        cu_seqlens: host offsets ``[0, ..., T]`` (a list, or a CPU int tensor; a
            CUDA tensor costs one synchronisation, here, once).
        device: where the device tables live (the inputs' device).
        max_docs: document capacity (default: this layout's count).
        max_chunks: chunk capacity (default: ``ceil(T / chunk_size) + max_docs - 1``
            when ``max_docs`` is given — enough for any layout of ``T`` tokens in
            ``max_docs`` documents — else this layout's count).

    Attributes: ``offsets`` (real host offsets), ``padded_offsets`` (host,
    ``max_docs + 1``), ``cu_seqlens`` (device int32 ``[max_docs + 1]``),
    ``index`` (:class:`PaddedChunkIndex`), ``doc_pos`` (device int32 ``[T]``),
    ``handle`` (see :mod:`gdn_core.custom_ops`).
    """

    def __init__(self, cu_seqlens, *, device: torch.device | str = "cpu",
                 max_docs: int | None = None, max_chunks: int | None = None,
                 chunk_size: int = CHUNK_SIZE) -> None:
        offs = _host_offsets(cu_seqlens)
        _check_offsets(offs)
        T = offs[-1]
        N = len(offs) - 1
        for name, val in (("max_docs", max_docs), ("max_chunks", max_chunks)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if max_chunks is None:
            max_chunks = (math.ceil(T / chunk_size) + max_docs - 1 if max_docs is not None
                          else _num_chunks(offs, chunk_size))
        if max_docs is None:
            max_docs = N
        self.device = require_device(device)  # ValueError for a device not usable here
        self.total_tokens = T
        self.max_docs = max_docs
        self.max_chunks = max_chunks
        self.chunk_size = chunk_size
        self._check_fits(offs)
        tabs = layout_tables(offs, max_docs, max_chunks, chunk_size)

        def dev(name: str) -> torch.Tensor:
            return torch.tensor(tabs[name], dtype=torch.int32).to(self.device)

        self.cu_seqlens = dev("cu_seqlens")
        self.doc_pos = dev("doc_pos")
        self._tables = {
            "chunk_doc": dev("chunk_doc"), "chunk_start": dev("chunk_start"),
            "chunk_len": dev("chunk_len"), "doc_chunk_offsets": dev("chunk_offsets"),
        }
        self._set_host(offs, tabs)
        self.handle = register_handle(self)

    # ---------------------------------------------------------------- host --

    def _check_fits(self, offs: tuple[int, ...]) -> None:
        T, N = offs[-1], len(offs) - 1
        if T != self.total_tokens:
            raise ValueError(f"cu_seqlens must end at T={self.total_tokens} (this layout's token "
                             f"count), got {T}")
        if N > self.max_docs:
            raise ValueError(f"cu_seqlens holds {N} documents, more than max_docs="
                             f"{self.max_docs}")
        NT = _num_chunks(offs, self.chunk_size)
        if NT > self.max_chunks:
            raise ValueError(f"the layout has {NT} chunks, more than max_chunks={self.max_chunks}")
        if NT < self.max_chunks and T == 0:
            raise ValueError("a layout of 0 tokens cannot hold padding chunks; use max_chunks=0")

    def _set_host(self, offs: tuple[int, ...], tabs: dict[str, list[int]]) -> None:
        self.offsets = offs
        self.padded_offsets = tuple(tabs["cu_seqlens"])
        self.index = PaddedChunkIndex(
            offsets=self.padded_offsets,
            chunk_offsets=tuple(tabs["chunk_offsets"]),
            chunk_size=self.chunk_size,
            chunk_doc=self._tables["chunk_doc"],
            chunk_start=self._tables["chunk_start"],
            chunk_len=self._tables["chunk_len"],
            doc_offsets=self.cu_seqlens,
            doc_chunk_offsets=self._tables["doc_chunk_offsets"],
            chunk_capacity=self.max_chunks,
        )

    @property
    def num_docs(self) -> int:
        """Real documents (the padded count is ``max_docs``)."""
        return len(self.offsets) - 1

    @property
    def num_chunks(self) -> int:
        """Real chunks (the padded count is ``max_chunks``)."""
        return self.index.num_real_chunks

    def update(self, cu_seqlens) -> VarlenLayout:
        """Copy another layout of the same ``T`` (within the capacities) into this one's
        buffers, in place; returns ``self``. Outside a CUDA graph capture only."""
        offs = _host_offsets(cu_seqlens)
        _check_offsets(offs)
        self._check_fits(offs)
        tabs = layout_tables(offs, self.max_docs, self.max_chunks, self.chunk_size)
        for name, buf in (("cu_seqlens", self.cu_seqlens), ("doc_pos", self.doc_pos),
                          ("chunk_doc", self._tables["chunk_doc"]),
                          ("chunk_start", self._tables["chunk_start"]),
                          ("chunk_len", self._tables["chunk_len"]),
                          ("chunk_offsets", self._tables["doc_chunk_offsets"])):
            buf.copy_(torch.tensor(tabs[name], dtype=torch.int32))
        self._set_host(offs, tabs)
        return self

    def __repr__(self) -> str:
        return (f"VarlenLayout(T={self.total_tokens}, docs={self.num_docs}/{self.max_docs}, "
                f"chunks={self.num_chunks}/{self.max_chunks}, device={self.device})")
