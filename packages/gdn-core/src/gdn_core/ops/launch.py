"""Launching compiled Triton kernels without Triton's per-call argument binding.

``kernel[grid](*args, **kw)`` costs tens of microseconds of host time per launch in
Triton 3.6: it binds and specialises every argument, builds a cache key, checks the
kernel's globals and wraps launch metadata, before the compiled launcher runs. A
forward+backward launches 15-25 kernels, so at 1K-8K tokens per call that binding is a
large part of the host time that bounds the step (the GPU work is shorter).

:func:`cached_launch` wraps a ``@triton.jit`` kernel: the first launch of each
*specialisation* goes through Triton (compiling if needed) and remembers the compiled
kernel; later launches with the same specialisation call the compiled launcher directly.
The specialisation key is a superset of what Triton specialises on, computed per
argument from what the call passes:

* a tensor: its dtype, whether its address is a multiple of 16, and whether it is on
  CUDA (a cached launch passes the address itself: the compiled launcher then skips the
  ``data_ptr()`` call and the driver's pointer check it makes for a tensor object);
* an int: whether it is 1, whether it is a multiple of 16, and its width (i32/i64/u64);
* a float, a bool, ``None``: the kind only (Triton does not specialise on their values);
* a Gluon TMA descriptor: its dtype, block shape and shared layout (the layout object
  itself: equal layouts built twice take two entries);
* a ``tl.constexpr`` parameter and every launch option (``num_warps``...): the value;
* the current CUDA device.

A call whose key has been seen runs the kernel Triton compiled for that key, so it
launches exactly what ``kernel[grid]`` would have. An argument of any other kind, a
runtime argument passed by keyword, Triton's interpreter, or a launch hook installed by a
profiler sends the call through ``kernel[grid]`` unchanged. ``GDN_CORE_FAST_LAUNCH=0`` (read at
import) turns the cache off, for comparison.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FAST_LAUNCH_ENV", "ByIdentity", "CachedLauncher", "cached_launch", "descriptor_key",
           "slow_launches"]

#: ``0`` turns the launch cache off (every launch through ``kernel[grid]``)
FAST_LAUNCH_ENV = "GDN_CORE_FAST_LAUNCH"
_ENABLED = os.environ.get(FAST_LAUNCH_ENV, "1") != "0"
_MAX_ENTRIES = 512  # distinct specialisations kept per kernel before the cache restarts

try:  # Triton >= 3.4 keeps launch hooks in chains; the fast path needs them empty
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction as _JITFunction

    _HOOKS = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    _SUPPORTED = all(hasattr(h, "calls") for h in _HOOKS)
except Exception:  # noqa: BLE001 - another Triton: no fast path
    _JITFunction, _HOOKS, _SUPPORTED = None, (), False

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
if _raw_stream is None:  # a torch without it: the Stream object's handle
    def _raw_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream

try:  # Gluon's host TMA descriptor (Triton 3.6): specialised on dtype, block and layout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
except Exception:  # noqa: BLE001 - no Gluon: such an argument never appears
    _GluonDescriptor = None

try:  # how Triton's launcher turns a descriptor into launch values (Triton 3.6, CUDA)
    from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
except Exception:  # noqa: BLE001 - no such helper: a descriptor launch goes through run
    _make_tensordesc_arg = None

_I32_LO, _I32_HI, _I64_LO, _I64_HI = -(2**31), 2**31, -(2**63), 2**63
_UNSUPPORTED = object()
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


_INT_KEYS: dict[int, int] = {}  # memo of _int_key: a launch's ints repeat call to call
_INT_KEYS_MAX = 4096


def _int_key(v: int) -> int:
    """What Triton specialises an int on, as bits: equal to 1, a multiple of 16, within
    int32, within int64 (neither: unsigned 64); remembered in ``_INT_KEYS``."""
    k = ((v == 1) | ((v & 15) == 0) << 1 | (_I32_LO <= v < _I32_HI) << 2
         | (_I64_LO <= v < _I64_HI) << 3)
    if len(_INT_KEYS) >= _INT_KEYS_MAX:
        _INT_KEYS.clear()
    _INT_KEYS[v] = k
    return k


class ByIdentity:
    """Wraps an object so that it hashes and compares by identity."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByIdentity) and other.obj is self.obj


def descriptor_key(desc: Any) -> tuple:
    """What a Gluon descriptor argument specialises a kernel on: its dtype, block shape
    and shared layout (the layout, unhashable, by identity, held by the key so that its
    id is not reused). A descriptor built by :mod:`gdn_core.ops.gluon.tma` carries its
    key already (``_gdn_key``)."""
    key = getattr(desc, "_gdn_key", None)
    if key is None:
        key = ("desc", desc.base.dtype, tuple(desc.block_shape), ByIdentity(desc.layout))
    return key


class _Entry:
    """A compiled specialisation: the kernel, the values of the parameters after the
    positional ones, and (when its launcher allows) the C launch function itself with
    what a descriptor argument expands to."""

    __slots__ = ("compiled", "tail", "desc_at", "c_launch", "coop", "pdl", "desc_meta")

    def __init__(self, compiled: Any, tail: tuple, desc_at: tuple[int, ...]) -> None:
        self.compiled, self.tail, self.desc_at = compiled, tail, desc_at
        self.c_launch = self.desc_meta = None
        self.coop = self.pdl = False
        run = compiled.run
        if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
                or not hasattr(run, "launch")):
            return  # scratch to allocate per launch, or another launcher: compiled.run
        launch, metas = run.launch, None
        if getattr(launch, "__name__", "") == "inner":  # descriptors: Triton's wrapper
            cells = dict(zip(launch.__code__.co_freevars,
                             (c.cell_contents for c in launch.__closure__ or ())))
            metas = cells.get("tensordesc_meta")
            launch = cells.get("launcher")
            if (launch is None or _make_tensordesc_arg is None or not metas
                    or len(metas) != len(desc_at) or any(m is None for m in metas)
                    or sorted(cells.get("tensordesc_indices", ())) != list(desc_at)):
                return
            metas = tuple((m, repr(sorted(m.items()))) for m in metas)
        elif desc_at:
            return
        self.c_launch, self.desc_meta = launch, metas
        self.coop, self.pdl = bool(run.launch_cooperative_grid), bool(run.launch_pdl)


_EXPANDED: dict[tuple, tuple] = {}  # (address, shape, strides, metadata) -> launch values
_EXPANDED_MAX = 4096


def _expand(desc: Any, meta: tuple[dict, tuple]) -> tuple:
    """The values Triton's launcher passes for a Gluon descriptor argument: the encoded
    ``CUtensorMap`` (one ``cuTensorMapEncodeTiled`` per address and geometry, remembered:
    it depends on nothing else), the shape and the strides."""
    key = (desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), meta[1])
    got = _EXPANDED.get(key)
    if got is None:
        if len(_EXPANDED) >= _EXPANDED_MAX:
            _EXPANDED.clear()
        got = _EXPANDED[key] = tuple(_make_tensordesc_arg(desc, meta[0]))
    return got


class CachedLauncher:
    """``kernel[grid](...)`` with the compiled kernel remembered per specialisation.

    Use as the kernel itself: ``CachedLauncher(kernel)[grid](*args, **kwargs)``.
    ``kernel`` stays the ``@triton.jit`` function (scans and compile reports use it).
    The fast path takes the runtime arguments positionally and constexprs and launch
    options (``num_warps``...) by keyword, as this library's launchers call; a runtime
    argument passed by keyword sends the call through ``kernel[grid]``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._fast = (_ENABLED and _SUPPORTED and isinstance(kernel, _JITFunction)
                      and os.environ.get("TRITON_INTERPRET") != "1")
        params = getattr(kernel, "params", ())
        self._names = tuple(p.name for p in params)
        self._constexpr = tuple(p.is_constexpr for p in params)
        self._runtime_names = frozenset(
            p.name for p in params if not p.is_constexpr)
        self._defaults = tuple(p.default if p.has_default else _UNSUPPORTED for p in params)
        self._cache: dict[tuple, _Entry] = {}
        #: launches on the fast-path machinery that went through ``kernel[grid]`` because
        #: the call has no key (a runtime argument by keyword, an argument of another
        #: kind): each pays Triton's binding again; a host benchmark reports the sum
        #: (:func:`slow_launches`)
        self.unkeyed_calls = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if not self._fast or callable(grid):
            return self.kernel[grid]
        return functools.partial(self._launch, grid)

    def tail(self, n_args: int, kwargs: dict[str, Any]) -> tuple | None:
        """The values of the parameters after the first ``n_args`` (given positionally),
        from ``kwargs`` or their defaults, in signature order (``None``: one is missing,
        which Triton reports itself)."""
        values = []
        for name, default in zip(self._names[n_args:], self._defaults[n_args:]):
            v = kwargs.get(name, default)
            if v is _UNSUPPORTED:
                return None
            values.append(v)
        return tuple(values)

    def call_key(self, device: int, args: tuple,
                 kwargs: dict[str, Any]) -> tuple[tuple | None, list[Any]]:
        """The cache key of a call (``None``: the call takes Triton's path) and the values
        to launch its positional arguments with: each tensor replaced by its address (the
        compiled launcher then skips the ``data_ptr()`` call and the driver's pointer check
        it makes for a tensor object; a tensor that is not on CUDA keys apart, so that
        Triton's own path reports it).

        The key holds the device, the number of positional arguments, the keyword
        arguments as given (constexprs and launch options: their values), each positional
        constexpr's value and each positional runtime argument's class (:mod:`the module
        docstring <gdn_core.ops.launch>`; a descriptor's: :func:`descriptor_key`)."""
        if len(args) > len(self._names) or not self._runtime_names.isdisjoint(kwargs):
            return None, list(args)
        key: list[Any] = [device, len(args), tuple(kwargs.items())]
        head = list(args)
        for i, (v, const) in enumerate(zip(args, self._constexpr)):
            cls = v.__class__
            if const:
                key.append(v)
            elif cls is _Tensor or cls is _Parameter or isinstance(v, _Tensor):
                ptr = v.data_ptr()
                key.append((v.dtype, (ptr & 15) == 0, v.is_cuda))
                head[i] = ptr
            elif cls is int:
                k = _INT_KEYS.get(v)
                if k is None:
                    k = _int_key(v)
                key.append(k)
            elif cls is float:
                key.append("fp32")
            elif cls is bool:
                key.append("u1")
            elif v is None:
                key.append("none")
            elif cls is _GluonDescriptor and cls is not None:
                key.append(descriptor_key(v))
            else:
                return None, head
        return tuple(key), head

    def _launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
        if _HOOKS[0].calls or _HOOKS[1].calls:  # a profiler is listening: Triton's path
            return self.kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key, head = self.call_key(device, args, kwargs)
        try:
            entry = None if key is None else self._cache.get(key)
        except TypeError:  # an unhashable constexpr or option
            key = entry = None
        if entry is None:
            return self._first_launch(grid, key, args, kwargs)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled = entry.compiled
        if entry.c_launch is None:
            compiled.run(grid[0], g1, g2, _raw_stream(device), compiled.function,
                         compiled.packed_metadata, None, None, None, *head, *entry.tail)
            return compiled
        if entry.desc_meta:  # each descriptor becomes its encoded map, shape and strides
            for at, meta in zip(reversed(entry.desc_at), reversed(entry.desc_meta)):
                head[at:at + 1] = _expand(head[at], meta)
        entry.c_launch(grid[0], g1, g2, _raw_stream(device), compiled.function, entry.coop,
                       entry.pdl, None, None, compiled.packed_metadata, None, None, None,
                       *head, *entry.tail)
        return compiled

    def _first_launch(self, grid: tuple[int, ...], key: tuple | None, args: tuple,
                      kwargs: dict[str, Any]) -> Any:
        """Launch through Triton (compiling if needed) and remember what it ran."""
        if key is None:
            self.unkeyed_calls += 1
        compiled = self.kernel[grid](*args, **kwargs)
        tail = None if key is None else self.tail(len(args), kwargs)
        if tail is not None and getattr(compiled, "function", None) is not None:
            if len(self._cache) >= _MAX_ENTRIES:
                self._cache.clear()
            # equal keys put descriptors at equal positions (their key parts are tagged)
            desc_at = tuple(i for i, v in enumerate(args) if v.__class__ is _GluonDescriptor)
            self._cache[key] = _Entry(compiled, tail, desc_at)
        return compiled


_ALL: list[CachedLauncher] = []  # every wrapper made, for slow_launches


def cached_launch(kernel: Any) -> CachedLauncher:
    """Wrap a ``@triton.jit`` kernel so that repeated launches skip Triton's binding
    (:class:`CachedLauncher`); any other kernel object is launched as it is."""
    wrapper = CachedLauncher(kernel)
    _ALL.append(wrapper)
    return wrapper


def slow_launches() -> dict[str, int]:
    """``{kernel name: calls}`` of the cached launches so far that had no key and so went
    through Triton's binding (:attr:`CachedLauncher.unkeyed_calls`; only on CUDA, where
    the fast path runs). Empty when every launch took the fast path or its first-call
    compile."""
    return {getattr(w.kernel, "__name__", repr(w.kernel)): w.unkeyed_calls
            for w in _ALL if w.unkeyed_calls}

