"""Registry of kernel launchers: which use atomics, and a record of launches.

Every kernel launcher in :mod:`gdn_core.ops` is declared with
:func:`launcher`, stating whether the kernel it launches uses atomics. The
declaration returns the function itself (no wrapper: a launch costs no extra
Python frame); :func:`record_launches` captures the declared launchers called
inside a ``with`` block through a profile hook that exists only inside the
block, so a test can prove that a deterministic call launched no atomic-using
kernel::

    with record_launches() as launches:
        chunk_gdn_bwd(..., deterministic=True)
    assert not [l for l in launches if l.uses_atomics]

``tools``/tests also cross-check the declaration against the kernel source
(:func:`registered_launchers` gives the kernels to scan).
"""

from __future__ import annotations

import contextlib
import sys
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
_BY_CODE: dict[Any, Launch] = {}  # a launcher's code object → what a call records


def launcher(*, uses_atomics: bool, kernels: tuple[Any, ...] = ()) -> Callable[[F], F]:
    """Declare a kernel launcher. ``kernels``: the ``@triton.jit`` functions it launches.

    Returns the function unchanged (with a ``launcher_info`` attribute)."""

    def declare(fn: F) -> F:
        name = f"{fn.__module__}.{fn.__qualname__}"
        _REGISTRY[name] = LauncherInfo(name, uses_atomics, tuple(kernels))
        _BY_CODE[fn.__code__] = Launch(name, uses_atomics)
        fn.launcher_info = _REGISTRY[name]  # type: ignore[attr-defined]
        return fn

    return declare


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Record every declared launcher called in this thread inside the block, in call
    order (a block nested in another records into both)."""
    log: list[Launch] = []
    previous_hook = sys.getprofile()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            hit = _BY_CODE.get(frame.f_code)
            if hit is not None:
                log.append(hit)
        if previous_hook is not None:
            previous_hook(frame, event, arg)

    sys.setprofile(hook)
    try:
        yield log
    finally:
        sys.setprofile(previous_hook)


def registered_launchers() -> dict[str, LauncherInfo]:
    """All launchers registered so far (import :mod:`gdn_core.ops` first)."""
    return dict(_REGISTRY)
