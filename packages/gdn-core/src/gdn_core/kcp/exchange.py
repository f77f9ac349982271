"""Communication of the KCP composition: all-gather, ring, and a simulated world.

The per-rank algorithms of :mod:`gdn_core.kcp.compose` are written as Python
generators that ``yield`` a request at every communication point and receive
its result back::

    gathered = yield AllGather(slot)          # -> [world_size, *slot.shape]
    carry_in = yield RingPass(carry, step)    # receive, step, send on

An *executor* answers the requests. :class:`ProcessGroupExchange` runs them as
``torch.distributed`` collectives (gloo on CPU, NCCL on GPUs);
:class:`LocalExchange` is the world of one rank (no process group, nothing
sent); :func:`drive_simulated` advances the generators of every rank of a
world in one process, answering each collective once all ranks have reached
it — the single-GPU ``--simulate`` path and the CPU tests. Every rank yields
the same sequence of requests (all ranks take part in every collective), and
every exchanged tensor has a shape fixed by the plan (``world_size`` slots of
the state's shape), never by the document layout.

Ring semantics (``reverse=False``): rank ``r`` receives ``carry_in`` from
``r-1`` into its ``carry`` buffer (rank 0 keeps the buffer's contents), then,
if ``r+1`` exists, computes ``step(carry_in)`` and sends it to ``r+1``; the
request's result is ``carry_in``. ``reverse=True`` runs from the last rank
down. The simulated world runs the same steps in the same order, so both give
the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AllGather",
    "RingPass",
    "LocalExchange",
    "ProcessGroupExchange",
    "drive",
    "drive_simulated",
]


@dataclass
class AllGather:
    """All-gather ``tensor`` (same shape and dtype on every rank) → ``[world, *shape]``.

    ``out``: an optional preallocated ``[world, *shape]`` buffer to receive into.
    """

    tensor: torch.Tensor
    out: torch.Tensor | None = None


@dataclass
class RingPass:
    """One pass of a carry along the ranks (see the module docstring)."""

    carry: torch.Tensor
    step: Callable[[torch.Tensor], torch.Tensor]
    reverse: bool = False


Request = AllGather | RingPass
Steps = Generator[Request, Any, Any]


def _gather_buffer(req: AllGather, world_size: int) -> torch.Tensor:
    shape = (world_size, *req.tensor.shape)
    if req.out is not None:
        if tuple(req.out.shape) != shape or req.out.dtype != req.tensor.dtype:
            raise ValueError(f"all-gather buffer is {tuple(req.out.shape)} {req.out.dtype}, "
                             f"expected {shape} {req.tensor.dtype}")
        return req.out
    return req.tensor.new_empty(shape)


class LocalExchange:
    """The executor of a world of one rank: nothing is sent."""

    world_size = 1
    rank = 0

    def __call__(self, req: Request) -> torch.Tensor:
        if isinstance(req, AllGather):
            out = _gather_buffer(req, 1)
            out[0].copy_(req.tensor)
            return out
        if isinstance(req, RingPass):
            return req.carry  # no neighbour: nothing received, step not needed
        raise TypeError(f"unknown exchange request {type(req).__name__}")


class ProcessGroupExchange:
    """The executor over a ``torch.distributed`` process group."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def _global(self, r: int) -> int:
        import torch.distributed as dist

        if self.group is None or self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def __call__(self, req: Request) -> torch.Tensor:
        import torch.distributed as dist

        if isinstance(req, AllGather):
            out = _gather_buffer(req, self.world_size)
            dist.all_gather(list(out.unbind(0)), req.tensor.contiguous(), group=self.group)
            return out
        if isinstance(req, RingPass):
            d = -1 if req.reverse else 1
            src, dst = self.rank - d, self.rank + d
            carry = req.carry
            if 0 <= src < self.world_size:
                dist.recv(carry, src=self._global(src), group=self.group)
            if 0 <= dst < self.world_size:
                dist.send(req.step(carry).contiguous(), dst=self._global(dst), group=self.group)
            return carry
        raise TypeError(f"unknown exchange request {type(req).__name__}")


def drive(steps: Steps, executor: Callable[[Request], Any]) -> Any:
    """Run one rank's generator to completion, answering requests with ``executor``."""
    try:
        req = next(steps)
        while True:
            req = steps.send(executor(req))
    except StopIteration as stop:
        return stop.value


def _payload(req: Request) -> torch.Tensor:
    return req.tensor if isinstance(req, AllGather) else req.carry


def _check_same_payload(reqs: list[Request]) -> None:
    """Raise ``ValueError`` unless every rank's tensor of one collective has the same
    shape and dtype (over a process group, gloo would abort the process or hang)."""
    metas = [(tuple(_payload(r).shape), _payload(r).dtype) for r in reqs]
    if len(set(metas)) > 1:
        shown = ", ".join(f"rank {i}: {list(s)} {str(d).removeprefix('torch.')}"
                          for i, (s, d) in enumerate(metas))
        raise ValueError(
            f"simulated world: the ranks' tensors of one {type(reqs[0]).__name__} differ "
            f"({shown}); every rank must call with the same heads, head dimensions and "
            "dtype")


def drive_simulated(all_steps: list[Steps]) -> list[Any]:
    """Run every rank's generator of one world in this process; return their results.

    Each collective is answered once every rank has reached it; a rank that
    finishes (or requests something else) while others wait is a protocol
    error (``RuntimeError``) — it would deadlock a real process group.
    """
    W = len(all_steps)
    results: list[Any] = [None] * W
    pending: list[Request | None] = [None] * W
    done = [False] * W
    answers: list[Any] = [None] * W
    first = True
    while True:
        for r, steps in enumerate(all_steps):
            try:
                pending[r] = next(steps) if first else steps.send(answers[r])
            except StopIteration as stop:
                results[r] = stop.value
                done[r] = True
                pending[r] = None
        first = False
        if all(done):
            return results
        kinds = {type(p) for p in pending}
        if any(done) or len(kinds) != 1:
            raise RuntimeError(
                "simulated world: ranks disagree on the next collective "
                f"({[type(p).__name__ if p is not None else 'finished' for p in pending]})"
            )
        reqs = pending
        _check_same_payload(reqs)
        if isinstance(reqs[0], AllGather):
            shared = None  # ranks without a buffer share one (read-only) result
            for r in range(W):
                if reqs[r].out is None and shared is not None:
                    answers[r] = shared
                    continue
                out = _gather_buffer(reqs[r], W)
                for s in range(W):
                    out[s].copy_(reqs[s].tensor)
                answers[r] = out
                if reqs[r].out is None:
                    shared = out
        elif isinstance(reqs[0], RingPass):
            rev = reqs[0].reverse
            if any(p.reverse != rev for p in reqs):
                raise RuntimeError("simulated world: ring passes of opposite directions")
            order = range(W - 1, -1, -1) if rev else range(W)
            sent: torch.Tensor | None = None
            for i, r in enumerate(order):
                carry = reqs[r].carry
                if i > 0:
                    carry.copy_(sent)
                answers[r] = carry
                if i < W - 1:
                    sent = reqs[r].step(carry)
        else:  # pragma: no cover
            raise TypeError(f"unknown exchange request {type(reqs[0]).__name__}")
