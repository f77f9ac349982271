"""Registry of kernel launchers: which use atomics, and a record of launches.

Every Triton launcher in :mod:`gdn_core.ops` is wrapped with
:func:`launcher`, declaring whether the kernel it launches uses
``tl.atomic_*``. :func:`record_launches` captures the launches made inside a
``with`` block, so a test can prove that a deterministic call launched no
atomic-using kernel::

    with record_launches() as launches:
        chunk_gdn_bwd(..., deterministic=True)
    assert not [l for l in launches if l.uses_atomics]

``tools``/tests also cross-check the declaration against the kernel source
(:func:`registered_launchers` gives the kernels to scan).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Launch", "LauncherInfo", "launcher", "record_launches", "registered_launchers"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class LauncherInfo:
    name: str
    uses_atomics: bool
    kernels: tuple[Any, ...]  # the triton.jit functions it may launch


@dataclass(frozen=True)
class Launch:
    name: str
    uses_atomics: bool


_REGISTRY: dict[str, LauncherInfo] = {}
_state = threading.local()


def launcher(*, uses_atomics: bool, kernels: tuple[Any, ...] = ()) -> Callable[[F], F]:
    """Declare a kernel launcher. ``kernels``: the ``@triton.jit`` functions it launches."""

    def wrap(fn: F) -> F:
        name = f"{fn.__module__}.{fn.__qualname__}"
        _REGISTRY[name] = LauncherInfo(name, uses_atomics, tuple(kernels))

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            log = getattr(_state, "log", None)
            if log is not None:
                log.append(Launch(name, uses_atomics))
            return fn(*args, **kwargs)

        run.launcher_info = _REGISTRY[name]  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Record every registered launcher called in this thread inside the block."""
    previous = getattr(_state, "log", None)
    _state.log = []
    try:
        yield _state.log
    finally:
        _state.log = previous


def registered_launchers() -> dict[str, LauncherInfo]:
    """All launchers registered so far (import :mod:`gdn_core.ops` first)."""
    return dict(_REGISTRY)
