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
launches exactly what ``kernel[grid]`` would have. An argument of any other kind,
Triton's interpreter, or a launch hook installed by a profiler sends
the call through ``kernel[grid]`` unchanged. ``GDN_CORE_FAST_LAUNCH=0`` (read at
import) turns the cache off, for comparison.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FAST_LAUNCH_ENV", "CachedLauncher", "cached_launch"]

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

_INT32 = (-(2**31), 2**31)
_INT64 = (-(2**63), 2**63)
_UNSUPPORTED = object()


def _int_class(v: int) -> tuple[int, bool, bool]:
    width = 32 if _INT32[0] <= v < _INT32[1] else 64 if _INT64[0] <= v < _INT64[1] else 65
    return width, v == 1, v % 16 == 0


def _runtime_class(v: Any) -> Any:
    """What Triton's specialisation of a non-constexpr argument other than a tensor can
    depend on."""
    cls = v.__class__
    if cls is bool:
        return "u1"
    if cls is int:
        return _int_class(v)
    if cls is float:
        return "fp32"
    if v is None:
        return "none"
    if cls is _GluonDescriptor and cls is not None:
        # Triton's type names the block's dtype, shape and shared layout; the base address,
        # shape and strides are filled in at each launch. The layout (unhashable) keys by
        # identity, held by the key so that its id cannot be reused.
        return "desc", v.base.dtype, tuple(v.block_shape), _Same(v.layout)
    return _UNSUPPORTED


class _Same:
    """Wraps an object so that it hashes and compares by identity."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


class CachedLauncher:
    """``kernel[grid](...)`` with the compiled kernel remembered per specialisation.

    Use as the kernel itself: ``CachedLauncher(kernel)[grid](*args, **kwargs)``.
    ``kernel`` stays the ``@triton.jit`` function (scans and compile reports use it)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._fast = (_ENABLED and _SUPPORTED and isinstance(kernel, _JITFunction)
                      and os.environ.get("TRITON_INTERPRET") != "1")
        params = getattr(kernel, "params", ())
        self._names = tuple(p.name for p in params)
        self._name_set = frozenset(self._names)
        self._constexpr = tuple(p.is_constexpr for p in params)
        self._defaults = tuple(p.default if p.has_default else _UNSUPPORTED for p in params)
        self._cache: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if not self._fast or callable(grid):
            return self.kernel[grid]
        return functools.partial(self._launch, grid)

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> list[Any] | None:
        """Every parameter's value in signature order, defaults applied (``None``: an
        argument missing, which Triton reports itself)."""
        if len(args) > len(self._names):
            return None
        values = list(args)
        for name, default in zip(self._names[len(args):], self._defaults[len(args):]):
            v = kwargs.get(name, default)
            if v is _UNSUPPORTED:
                return None
            values.append(v)
        return values

    def specialisation_key(self, device: int, values: list[Any],
                           kwargs: dict[str, Any]) -> tuple[tuple | None, list[Any]]:
        """The cache key of a call with these bound ``values`` (:meth:`bind`) and launch
        options among ``kwargs`` (``None``: an argument the fast path does not take), and
        the values to launch with: each CUDA tensor replaced by its address (the compiled
        launcher takes an int as the pointer itself, without the ``data_ptr()`` call and
        the driver's pointer check it makes for a tensor; a tensor that is not on CUDA keys
        apart, so that Triton's own path reports it)."""
        key: list[Any] = [device]
        launch_values = list(values)
        for i, (v, const) in enumerate(zip(values, self._constexpr)):
            if const:
                key.append(v)
            elif isinstance(v, torch.Tensor):
                ptr = v.data_ptr()
                key.append((v.dtype, ptr % 16 == 0, v.is_cuda))
                launch_values[i] = ptr
            else:
                c = _runtime_class(v)
                if c is _UNSUPPORTED:
                    return None, values
                key.append(c)
        for name in sorted(kwargs.keys() - self._name_set):  # num_warps, num_stages, ...
            key.append((name, kwargs[name]))
        return tuple(key), launch_values

    def _launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
        if _HOOKS[0].calls or _HOOKS[1].calls:  # a profiler is listening: Triton's path
            return self.kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        values = self.bind(args, kwargs)
        key, launch_values = (None, values) if values is None else \
            self.specialisation_key(device, values, kwargs)
        try:
            compiled = None if key is None else self._cache.get(key)
        except TypeError:  # an unhashable constexpr or option
            key = compiled = None
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and getattr(compiled, "function", None) is not None:
                if len(self._cache) >= _MAX_ENTRIES:
                    self._cache.clear()
                self._cache[key] = compiled
            return compiled
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, _raw_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *launch_values)
        return compiled


def cached_launch(kernel: Any) -> CachedLauncher:
    """Wrap a ``@triton.jit`` kernel so that repeated launches skip Triton's binding
    (:class:`CachedLauncher`); any other kernel object is launched as it is."""
    return CachedLauncher(kernel)

