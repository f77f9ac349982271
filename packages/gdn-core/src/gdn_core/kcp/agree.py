"""What the ranks of a KCP world must agree on, checked by one small collective per context.

Ranks that disagree on the world, the plan, the heads, the dtype or the
exchange do not fail cleanly on their own: they wait for a peer that never
comes (a timeout), issue collectives of different shapes (gloo aborts the
process) or silently compute something else. So the context build of every
rank contributes a **record** — a fixed-length int64 vector, :data:`FIELDS` —
to one all-gather over the actual process group, and every rank decodes the
same table:

* the world (``world_size`` claimed by the plan, ``rank`` given, and the rank
  this process has in the group, ``group_rank``) — the gathered shape does not
  depend on any of them, so even a world-size mismatch meets in the collective;
* the plan: mode, boundary, chunk and segment sizes, its digest;
* the conv width (``conv_kernel_size``) and what the rank declared about its
  calls (:class:`RunSpec`: heads, head dimensions, dtype, exchange; ``-1``
  where nothing was declared);
* ``local_error``: this rank's own checks failed (it raises its own error; its
  peers raise a ``ValueError`` naming it), so a bad argument on one rank never
  leaves the others waiting.

A disagreement raises the same ``ValueError`` on every rank, naming each field
that differs and every rank's value.

What a rank did not declare at the build (``heads``, ``head_dims``, ``dtype``,
``exchange``) the build cannot know; the **first GDN forward with a given call
signature** on a context (:func:`call_signature`: ``H, HV, K, V``, the input dtype,
the exchange, ``use_qk_l2norm_in_kernel``) then all-gathers a second small record
(:data:`CALL_FIELDS`) before any exchange, and every rank raises the same
``ValueError`` if they differ. A signature agreed once is remembered by the context:
the calls of a training step after the first cost no collective. (Not covered: a
rank repeating an agreed signature while a peer makes a new one — the first skips
the check its peer waits in.) With ``check_inputs=True`` that record is gathered on
every call and carries the rank's own value check, so one rank's bad value stops
every rank. The split API's backward with ``check_inputs=True`` gathers a third record
(:func:`make_backward_record`: whether this rank's forward inputs were modified in place
since), so that such a rank stops every rank before the backward's first exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CALL_FIELDS", "FIELDS", "RunSpec", "agreement_error", "backward_agreement_error",
           "call_agreement_error", "call_signature", "exchange_records",
           "make_backward_record", "make_call_record", "make_record"]

_FORMAT = 0x47444E4B43500001  # "GDNKCP" + record format 1
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_EXCHANGES = ("allgather", "ring")
_BOUNDARIES = ("even", "chunk", "doc", "segment")
UNSET = -1

FIELDS = (
    "format", "local_error", "world_size", "rank", "group_rank", "deterministic",
    "boundary", "chunk_size", "segment_size", "conv_kernel_size",
    "H", "HV", "K", "V", "dtype", "exchange",
    "digest0", "digest1", "digest2", "digest3",
)


def _positive_pair(name: str, val: Any, parts: str) -> tuple[int, int] | None:
    if val is None:
        return None
    if not (isinstance(val, (tuple, list)) and len(val) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in val)):
        raise ValueError(f"{name} must be a pair of positive ints {parts}, got {val!r}")
    return int(val[0]), int(val[1])


@dataclass(frozen=True)
class RunSpec:
    """What a rank declares, at context build, about the calls it will make.

    ``heads``: ``(H, HV)``; ``head_dims``: ``(K, V)``; ``dtype``: of q, k, v,
    g, beta; ``exchange``: ``"allgather"`` or ``"ring"``. ``None``: not
    declared (not checked). Build it with :meth:`make`.
    """

    heads: tuple[int, int] | None = None
    head_dims: tuple[int, int] | None = None
    dtype: torch.dtype | None = None
    exchange: str | None = None

    @classmethod
    def make(cls, *, heads: Any = None, head_dims: Any = None, dtype: Any = None,
             exchange: Any = None) -> RunSpec:
        """Validate the declaration. Raises ``ValueError`` (bad value) / ``TypeError``
        (``dtype`` not a supported torch dtype)."""
        heads = _positive_pair("heads", heads, "(H, HV)")
        if heads is not None and heads[1] % heads[0]:
            raise ValueError(f"heads=(H, HV) needs HV a multiple of H, got {heads}")
        head_dims = _positive_pair("head_dims", head_dims, "(K, V)")
        if dtype is not None and dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of {_DTYPES} or None, got {dtype!r}")
        if exchange is not None and exchange not in _EXCHANGES:
            raise ValueError(f"exchange must be one of {_EXCHANGES} or None, got {exchange!r}")
        return cls(heads, head_dims, dtype, exchange)

    def check_call(self, *, H: int, HV: int, K: int, V: int, dtype: torch.dtype,
                   exchange: str) -> None:
        """Raise ``ValueError`` unless a call's sizes, dtype and exchange match what
        was declared (checked before any collective of the call)."""
        got = {"heads": (H, HV), "head_dims": (K, V), "dtype": dtype, "exchange": exchange}
        for name, val in got.items():
            want = getattr(self, name)
            if want is not None and want != val:
                raise ValueError(f"this call has {name}={val!r}, but the context was built "
                                 f"declaring {name}={want!r} (every rank agreed on it)")


def _code(val: Any, table: Sequence[Any]) -> int:
    return UNSET if val is None else table.index(val)


def make_record(plan: Any, rank: Any, group_rank: int, conv_kernel_size: Any,
                spec: RunSpec | None, local_error: bool) -> list[int]:
    """This rank's record (``len(FIELDS)`` ints); fields it cannot fill are ``-1``."""
    rec = dict.fromkeys(FIELDS, UNSET)
    rec.update(format=_FORMAT, local_error=int(local_error), group_rank=group_rank)
    if isinstance(rank, int) and not isinstance(rank, bool):
        rec["rank"] = rank
    if isinstance(conv_kernel_size, int) and not isinstance(conv_kernel_size, bool):
        rec["conv_kernel_size"] = conv_kernel_size
    if plan is not None:
        rec.update(world_size=plan.world_size, deterministic=int(plan.deterministic),
                   boundary=_code(plan.boundary, _BOUNDARIES), chunk_size=plan.chunk_size,
                   segment_size=plan.segment_size or UNSET)
        rec.update(zip(FIELDS[-4:], plan.digest_words()))
    if spec is not None:
        for names, pair in ((("H", "HV"), spec.heads), (("K", "V"), spec.head_dims)):
            if pair is not None:
                rec.update(zip(names, pair))
        rec["dtype"] = _code(spec.dtype, _DTYPES)
        rec["exchange"] = _code(spec.exchange, _EXCHANGES)
    return [rec[f] for f in FIELDS]


def exchange_records(record: list[int], group: Any, comm_device: torch.device) -> list[list[int]]:
    """All-gather ``record`` over ``group`` → every rank's record, in group rank order."""
    import torch.distributed as dist

    mine = torch.tensor(record, dtype=torch.int64, device=comm_device)
    got = torch.empty(dist.get_world_size(group), len(record), dtype=torch.int64,
                      device=comm_device)
    dist.all_gather(list(got.unbind(0)), mine, group=group)
    return got.cpu().tolist()


def _show(field: str, val: int) -> str:
    if val == UNSET:
        return "unset"
    tables = {"dtype": _DTYPES, "exchange": _EXCHANGES, "boundary": _BOUNDARIES}
    if field in tables and 0 <= val < len(tables[field]):
        return str(tables[field][val]).removeprefix("torch.")
    return str(val)


def _differences(records: list[list[int]]) -> list[str]:
    """One line per field on which the ranks differ (the digest as one field)."""
    lines = []
    for i, field in enumerate(FIELDS[:-4]):
        if field in ("rank", "group_rank", "local_error"):
            continue
        vals = [r[i] for r in records]
        if len(set(vals)) > 1:
            lines.append(f"{field}: " + ", ".join(f"rank {g}: {_show(field, v)}"
                                                  for g, v in enumerate(vals)))
    if len({tuple(r[-4:]) for r in records}) > 1:
        lines.append("plan digest mismatch across the group (every rank must build the same "
                     "plan from the same cu_seqlens, world_size, chunk_size and boundary)")
    return lines


def agreement_error(records: list[list[int]]) -> str | None:
    """The message every rank raises for these gathered records, or ``None`` if they agree.

    A function of the table alone, so every rank raises the same one.
    """
    size = len(records)
    col = {f: [r[i] for r in records] for i, f in enumerate(FIELDS)}
    if any(v != _FORMAT for v in col["format"]):
        return ("KCP context build: ranks run different record formats (different gdn_core "
                f"versions?): {[hex(v & (2**64 - 1)) for v in col['format']]}")
    failed = [g for g, v in enumerate(col["local_error"]) if v]
    if failed:
        return (f"KCP context build failed its own checks on ranks {failed} of {size} (see "
                f"their errors); every rank stops here")
    lines = _differences(records)
    worlds = set(col["world_size"])
    if not lines and worlds != {size}:
        lines.append(f"world_size: the plan was made for {worlds.pop()} ranks, but the "
                     f"process group has {size}")
    elif lines and worlds != {size}:
        lines.append(f"(the process group has {size} ranks)")
    if col["rank"] != col["group_rank"]:
        lines.append("rank: given " + ", ".join(
            f"rank={_show('rank', r)} in group rank {g}" for g, r in enumerate(col["rank"]))
            + " (each process must pass its own rank in the group)")
    if not lines:
        return None
    return "KCP ranks disagree at context build:\n  " + "\n  ".join(lines)


_CALL_FORMAT = 0x47444E4B43500101  # "GDNKCP" + call record format 1

CALL_FIELDS = ("format", "local_error", "H", "HV", "K", "V", "dtype", "exchange",
               "use_qk_l2norm_in_kernel")


def call_signature(*, H: int, HV: int, K: int, V: int, dtype: torch.dtype, exchange: str,
                   l2: bool) -> tuple[int, ...]:
    """What the ranks' GDN calls must agree on, as ints (``CALL_FIELDS[2:]``)."""
    return (H, HV, K, V, _code(dtype, _DTYPES), _code(exchange, _EXCHANGES), int(l2))


def make_call_record(signature: tuple[int, ...], local_error: bool) -> list[int]:
    """This rank's record of one call (``len(CALL_FIELDS)`` ints)."""
    return [_CALL_FORMAT, int(local_error), *signature]


def call_agreement_error(records: list[list[int]]) -> str | None:
    """The message every rank raises for these gathered call records, or ``None``."""
    size = len(records)
    col = {f: [r[i] for r in records] for i, f in enumerate(CALL_FIELDS)}
    if any(v != _CALL_FORMAT for v in col["format"]):
        return ("KCP GDN call: the ranks are not all in the same call (another collective, "
                "or another gdn_core version, met this call's agreement check)")
    failed = [g for g, v in enumerate(col["local_error"]) if v]
    if failed:
        return (f"KCP GDN call: check_inputs refused the inputs of ranks {failed} of {size} "
                f"(see their errors); every rank stops here")
    lines = []
    for field in CALL_FIELDS[2:]:
        vals = col[field]
        if len(set(vals)) > 1:
            lines.append(f"{field}: " + ", ".join(f"rank {g}: {_show(field, v)}"
                                                  for g, v in enumerate(vals)))
    if not lines:
        return None
    return ("KCP ranks disagree on a GDN call (undeclared at context build; checked at the "
            "first call with these arguments):\n  " + "\n  ".join(lines))


_BWD_FORMAT = 0x47444E4B43500201  # "GDNKCP" + backward record format 1


def make_backward_record(local_error: bool) -> list[int]:
    """This rank's record of one split-API backward: ``[format, local_error]``
    (``local_error``: an input of its forward was modified in place since)."""
    return [_BWD_FORMAT, int(local_error)]


def backward_agreement_error(records: list[list[int]]) -> str | None:
    """The message every rank raises for these gathered backward records, or ``None``."""
    if any(r[0] != _BWD_FORMAT for r in records):
        return ("KCP GDN backward: the ranks are not all in the same call (another "
                "collective, or another gdn_core version, met this backward's check)")
    failed = [g for g, r in enumerate(records) if r[1]]
    if failed:
        return (f"KCP GDN backward: inputs of the forward were modified in place on ranks "
                f"{failed} of {len(records)} (see their errors); every rank stops here")
    return None
