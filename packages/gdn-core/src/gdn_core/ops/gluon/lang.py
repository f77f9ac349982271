"""Gluon's Hopper API as the kernels of this package use it, imported in one place.

On a Triton without Gluon (an older one; the CPU machines' interpreter builds) the
import must not fail: the names then stand in (``gluon.jit`` returns the function
unchanged, the rest are ``None``), every kernel module still imports, and
:func:`require_sm90` says at launch why nothing can run.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["GLUON_ERROR", "fence_async_shared", "gl", "gluon", "mbarrier", "require_sm90",
           "tma", "warpgroup_mma", "warpgroup_mma_wait"]

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    #: why Gluon did not import here, or ``None``
    GLUON_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - any failure means "Gluon is not available"
    GLUON_ERROR = exc

    class _NoGluon:
        @staticmethod
        def jit(fn):
            return fn

    gluon = _NoGluon()
    gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None


def require_sm90(device: torch.device, what: str) -> None:
    """Check that ``what`` (a kernel's name for the message) can launch on ``device``.

    Raises:
        RuntimeError: Gluon is not importable here, ``device`` is not CUDA, or it is
            not compute capability 9.0 (the kernels are compiled for sm_90a).
    """
    if GLUON_ERROR is not None:
        raise RuntimeError(f"Gluon (triton.experimental.gluon, Triton >= 3.6) is not importable "
                           f"here: {GLUON_ERROR!r}")
    if device.type != "cuda":
        raise RuntimeError(f"{what} runs on CUDA sm_90 only, got device {device}")
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        raise RuntimeError(f"{what} is compiled for sm_90a only, device {device} is "
                           f"sm_{cap[0]}{cap[1]}")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``, read once (every Gluon launch asks:
    ``torch.cuda.get_device_capability`` is a properties query each time)."""
    return torch.cuda.get_device_capability(index)
