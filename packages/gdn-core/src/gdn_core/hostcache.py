"""Per-layout host bookkeeping and small device tables, built once and reused.

A training step calls the forward and the backward with the same document
layout (``cu_seqlens``), and consecutive steps often repeat it. Everything
derived from the layout alone — the chunk table, the segment layout, the fold
chains, the row and flag tables the kernels read — is therefore built once per
``(offsets, options, device)`` and kept in a small bounded LRU
(:class:`LRUCache`). Nothing that depends on tensor *values* other than the
host offsets is ever cached.

Device tables go to the device with **one** host→device copy per layout
(:func:`pack_tables`: one packed int32 buffer, sliced), made before the first
kernel of the step that needs them — a pageable copy issued between kernels
waits for the stream to drain, which turned small shapes launch-bound.

Cached device tensors are read-only by contract: kernels and torch indexing
only read them. A table built while the current CUDA stream is being captured
into a graph is not cached (its copy runs only when the graph replays).
"""

from __future__ import annotations

import array
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "LRUCache",
    "capturing",
    "device_int_tables",
    "device_key",
    "pack_tables",
    "tensor_values",
]

DEFAULT_CACHE_SIZE = 64
"""Entries per cache: layouts alternate between a handful per run, and each
entry holds a few KiB of host tuples and device int tables."""

_ALIGN = 16  # elements: every packed table starts 64-byte aligned (Triton's 16-byte pointer
#             specialisation sees the same alignment as a table of its own)

V = TypeVar("V")


class LRUCache:
    """A small thread-safe least-recently-used map with a fixed capacity."""

    def __init__(self, maxsize: int = DEFAULT_CACHE_SIZE) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = int(maxsize)
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_build(self, key: Hashable, build: Callable[[], V], *, store: bool = True) -> V:
        """The cached value of ``key``, or ``build()`` (cached when ``store``)."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.hits += 1
                return self._data[key]
            self.misses += 1
        value = build()  # outside the lock: building may launch copies
        if store:
            with self._lock:
                if key in self._data:  # another thread won the race: keep one object
                    self._data.move_to_end(key)
                    return self._data[key]
                self._data[key] = value
                while len(self._data) > self.maxsize:
                    self._data.popitem(last=False)
        return value

    def get(self, key: Hashable) -> Any:
        """The cached value of ``key`` (made most recent), or ``None``."""
        with self._lock:
            got = self._data.get(key)
            if got is None:
                self.misses += 1
            else:
                self._data.move_to_end(key)
                self.hits += 1
            return got

    def put(self, key: Hashable, value: Any) -> None:
        """Cache ``value`` under ``key`` (evicting the least recently used)."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data


class _ValuesEntry:
    """What :func:`tensor_values` read from one tensor object, and when."""

    __slots__ = ("ref", "version", "data_ptr", "values")

    def __init__(self, ref, version: int, data_ptr: int, values: tuple) -> None:
        self.ref, self.version, self.data_ptr, self.values = ref, version, data_ptr, values


_VALUES: dict[int, _ValuesEntry] = {}
_VALUES_LOCK = threading.Lock()
_VALUES_MAX = 32  # tensor objects remembered at once (a training step passes one or two)


def _forget(key: int, ref) -> None:
    with _VALUES_LOCK:
        entry = _VALUES.get(key)
        if entry is not None and entry.ref is ref:
            del _VALUES[key]


def tensor_values(t: torch.Tensor) -> tuple:
    """``tuple(t.tolist())`` of a 1-D tensor ``t`` (Python ints for an integer tensor),
    read once per tensor object while it is unchanged.

    Reading a CUDA tensor on the host waits for the stream (``tolist`` synchronises),
    and a synchronisation inside a call leaves the GPU idle while the host enqueues the
    rest of it. A model passes the same ``cu_seqlens`` tensor to every layer, forward
    and backward, so the values are remembered per tensor *object* (a weak reference:
    nothing is kept alive) together with its version counter and address; an in-place
    write (``t[1] = 5``, ``t.copy_(…)``) bumps the version, so the next call reads the
    tensor again. Writes that bypass autograd's version counter (through ``t.data`` or a
    raw pointer in a kernel) are not seen: don't modify a ``cu_seqlens`` tensor in place
    behind torch's back while calls use it. Inference-mode tensors (no version counter)
    are read on every call, and so is a CUDA tensor while its device's stream is being
    captured into a graph: the read fails there as it always did, rather than baking
    remembered values into a graph that may replay after the tensor changed (a captured
    step takes its documents from a :class:`~gdn_core.layout.VarlenLayout`).
    """
    if t.is_cuda and capturing(t.device):
        return tuple(t.tolist())
    try:
        version = t._version
    except RuntimeError:  # an inference tensor tracks no version: read it every time
        return tuple(t.tolist())
    key, ptr = id(t), t.data_ptr()
    with _VALUES_LOCK:
        entry = _VALUES.get(key)
        if (entry is not None and entry.ref() is t and entry.version == version
                and entry.data_ptr == ptr):
            return entry.values
    values = tuple(t.tolist())
    ref = weakref.ref(t, lambda r, k=key: _forget(k, r))
    with _VALUES_LOCK:
        _VALUES[key] = _ValuesEntry(ref, version, ptr, values)
        while len(_VALUES) > _VALUES_MAX:
            del _VALUES[next(iter(_VALUES))]
    return values


def device_key(device: torch.device | str) -> torch.device:
    """``device`` as a hashable :class:`torch.device` with its index (``cuda`` → ``cuda:N``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def capturing(device: torch.device) -> bool:
    """True while the current stream of ``device`` (CUDA) is captured into a graph."""
    if device.type != "cuda":
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # pragma: no cover - no CUDA runtime
        return False


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack_tables(tables: Sequence[tuple[Sequence[int], torch.dtype]],
                device: torch.device | str) -> list[torch.Tensor]:
    """Put small integer tables on ``device`` with one host→device copy.

    ``tables``: ``(values, dtype)`` pairs, ``dtype`` ``torch.int32`` or
    ``torch.int64``. Returns one contiguous 1-D tensor per table (slices of one
    buffer, each starting 64-byte aligned), in order, with exactly the values
    and dtypes asked for. (The host buffer is filled through :mod:`array`,
    several times faster than ``torch.tensor`` of a list.)
    """
    buf = bytearray()
    spans: list[tuple[int, int, torch.dtype]] = []
    for values, dtype in tables:
        if dtype == torch.int32:
            words = array.array("i", values)
        elif dtype == torch.int64:
            words = array.array("q", values)
        else:
            raise TypeError(f"pack_tables packs int32/int64 tables, got {dtype}")
        start = len(buf) // 4  # in int32 words
        buf += words.tobytes()
        spans.append((start, len(words), dtype))
        buf += bytes(-len(buf) % (4 * _ALIGN))
    dev = torch.device(device)
    if not buf:
        host = torch.zeros(0, dtype=torch.int32)
    else:
        host = torch.frombuffer(buf, dtype=torch.int32)
        if dev.type == "cpu":
            host = host.clone()  # own its memory
    packed = host.to(dev, non_blocking=True)
    out = []
    for start, n, dtype in spans:
        if dtype == torch.int64:
            out.append(packed[start:start + 2 * n].view(torch.int64))
        else:
            out.append(packed[start:start + n])
    return out


_INT_TABLES = LRUCache()


def device_int_tables(tables: Sequence[Sequence[int]], device: torch.device | str,
                      dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, ...]:
    """``tables`` (host int sequences) as device tensors of ``dtype``, one copy, cached.

    Keyed on the values themselves (tuples; a table given as a tuple is taken as it is,
    other sequences through ``int`` per element) and the device: a kernel launcher
    that is handed host lists per call (e.g. the fold chains of a layout)
    reaches its device tables without a host→device copy from the second call
    of a layout on.
    """
    dev = device_key(device)
    # a tuple (the layouts' memoised chain tables) keys as it is: hashed and compared in C,
    # where a per-element int() would cost Python work proportional to the layout per call
    key = (tuple(t if type(t) is tuple else tuple(int(x) for x in t) for t in tables), dev,
           dtype)
    return _INT_TABLES.get_or_build(
        key, lambda: tuple(pack_tables([(t, dtype) for t in key[0]], dev)),
        store=not capturing(dev),
    )
