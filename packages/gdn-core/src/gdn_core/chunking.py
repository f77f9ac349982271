"""Document and chunk bookkeeping shared by the references and the kernels.

Everything in this library works on a flat token axis: a fixed-length batch
``[B, T, ...]`` is ``B`` documents of ``T`` tokens laid end to end, a packed
batch ``[1, T, ...]`` with ``cu_seqlens`` is its documents. Chunks of
``CHUNK_SIZE`` tokens restart at every document start, so the last chunk of a
document may be short. The kernels address chunks through a :class:`ChunkIndex`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_SIZE = 64

__all__ = ["CHUNK_SIZE", "ChunkIndex", "document_bounds", "host_offsets"]


def host_offsets(cu_seqlens: torch.Tensor | list[int] | None, B: int, T: int) -> list[int]:
    """Document offsets ``[0, ..., B*T]`` as Python ints.

    ``cu_seqlens`` given (``B == 1``, validated by the caller) → its values;
    otherwise ``[0, T, 2T, ..., B*T]``. A CUDA ``cu_seqlens`` costs one host
    synchronisation; callers on a hot path pass a CPU tensor or a list.
    """
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)]
    if isinstance(cu_seqlens, torch.Tensor):
        return [int(x) for x in cu_seqlens.tolist()]
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
    """

    offsets: tuple[int, ...]
    chunk_offsets: tuple[int, ...]
    chunk_size: int
    chunk_doc: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    doc_offsets: torch.Tensor
    doc_chunk_offsets: torch.Tensor

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_chunks(self) -> int:
        return self.chunk_offsets[-1]

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    @classmethod
    def build(
        cls, offsets: list[int], device: torch.device | str, chunk_size: int = CHUNK_SIZE
    ) -> ChunkIndex:
        """Build the table from host document offsets (see :func:`host_offsets`)."""
        chunk_doc, chunk_start, chunk_len, chunk_offsets = [], [], [], [0]
        for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
            for start in range(bos, eos, chunk_size):
                chunk_doc.append(n)
                chunk_start.append(start)
                chunk_len.append(min(chunk_size, eos - start))
            chunk_offsets.append(len(chunk_doc))

        def dev(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True)

        return cls(
            offsets=tuple(offsets),
            chunk_offsets=tuple(chunk_offsets),
            chunk_size=chunk_size,
            chunk_doc=dev(chunk_doc),
            chunk_start=dev(chunk_start),
            chunk_len=dev(chunk_len),
            doc_offsets=dev(list(offsets)),
            doc_chunk_offsets=dev(chunk_offsets),
        )
