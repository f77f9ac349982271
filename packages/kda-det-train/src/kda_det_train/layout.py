"""Chunk layout of a packed sequence: token ↔ chunk gathers and the step order.

All movement of data between the flat token axis and the chunked layout is a
gather (``index_select``) with indices built once on the host: no scatters, so
nothing depends on the order in which threads write.

*Chunk space.* Every document is cut into chunks of ``C`` tokens starting at
its first token; the last chunk of a document is padded with zero rows (zero
``q, k, v, β`` and zero log decay, so a padded row changes nothing). Chunks of
all documents are numbered in document order: ``[NT, C, ...]``.

*Step order.* The chunk-state recurrence is sequential along a document but
independent across documents. Step ``s`` processes chunk ``s`` of every
document that has more than ``s`` chunks. With the documents sorted by chunk
count (descending, ties by document index), the documents active at step ``s``
are a prefix of that order, and the chunks of step ``s`` are one contiguous
slice of the step-major permutation of the chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ChunkLayout"]


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    offsets: tuple[int, ...]  # document offsets on the flat token axis [N+1]
    chunk_size: int
    doc_num_chunks: tuple[int, ...]  # [N]
    step_offsets: tuple[int, ...]  # [n_steps + 1] into the step-major chunk order
    slot_to_token: torch.Tensor  # [NT*C] long: token of each chunk slot (T_total for a pad)
    token_to_slot: torch.Tensor  # [T_total] long: chunk slot of each token
    step_perm: torch.Tensor  # [NT] long: chunk id at each step-major position
    step_inv: torch.Tensor  # [NT] long: step-major position of each chunk id
    doc_order: torch.Tensor  # [N] long: document at each sorted position
    doc_rank: torch.Tensor  # [N] long: sorted position of each document

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_chunks(self) -> int:
        return sum(self.doc_num_chunks)

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def num_steps(self) -> int:
        return len(self.step_offsets) - 1

    @classmethod
    def build(cls, offsets, chunk_size: int, device: torch.device) -> ChunkLayout:
        offsets = tuple(int(x) for x in offsets)
        C = chunk_size
        total = offsets[-1]
        doc_num_chunks = [-(-(eos - bos) // C) for bos, eos in zip(offsets[:-1], offsets[1:])]
        doc_first_chunk = [0]
        for n in doc_num_chunks:
            doc_first_chunk.append(doc_first_chunk[-1] + n)

        # Gather indices, built vectorised on the host.
        bos = torch.tensor(offsets[:-1], dtype=torch.long)
        lengths = torch.tensor(offsets[1:], dtype=torch.long) - bos
        chunks = torch.tensor(doc_num_chunks, dtype=torch.long)
        first = torch.tensor(doc_first_chunk[:-1], dtype=torch.long)
        tok_doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        token_to_slot = first[tok_doc] * C + torch.arange(total) - bos[tok_doc]
        chunk_doc = torch.repeat_interleave(torch.arange(len(lengths)), chunks)
        chunk_pos = torch.arange(int(chunks.sum())) - first[chunk_doc]  # chunk index in its doc
        chunk_start = bos[chunk_doc] + chunk_pos * C
        chunk_end = bos[chunk_doc] + lengths[chunk_doc]
        slot = chunk_start[:, None] + torch.arange(C)[None, :]
        slot_to_token = torch.where(slot < chunk_end[:, None], slot, total).reshape(-1)

        n_docs = len(doc_num_chunks)
        order = sorted(range(n_docs), key=lambda n: (-doc_num_chunks[n], n))
        rank = [0] * n_docs
        for r, n in enumerate(order):
            rank[n] = r
        step_perm, step_offsets = [], [0]
        n_steps = max(doc_num_chunks, default=0)
        for s in range(n_steps):
            for n in order:
                if doc_num_chunks[n] <= s:
                    break
                step_perm.append(doc_first_chunk[n] + s)
            step_offsets.append(len(step_perm))
        step_inv = [0] * len(step_perm)
        for pos, c in enumerate(step_perm):
            step_inv[c] = pos

        def dev(x) -> torch.Tensor:
            return torch.as_tensor(x, dtype=torch.long).to(device)

        return cls(
            offsets=offsets,
            chunk_size=C,
            doc_num_chunks=tuple(doc_num_chunks),
            step_offsets=tuple(step_offsets),
            slot_to_token=dev(slot_to_token),
            token_to_slot=dev(token_to_slot),
            step_perm=dev(step_perm),
            step_inv=dev(step_inv),
            doc_order=dev(order),
            doc_rank=dev(rank),
        )

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[T_total, HV, D]`` → head-major chunk space ``[NT, HV, C, D]`` (zero pads)."""
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        x = x.index_select(0, self.slot_to_token)
        x = x.view(self.num_chunks, self.chunk_size, *x.shape[1:])
        return x.transpose(1, 2).contiguous()

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Head-major chunk space ``[NT, HV, C, D]`` → ``[T_total, HV, D]`` (pads dropped)."""
        NT, HV, C = x.shape[:3]
        x = x.transpose(1, 2).reshape(NT * C, HV, *x.shape[3:])
        return x.index_select(0, self.token_to_slot)
