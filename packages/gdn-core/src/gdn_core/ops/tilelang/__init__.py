"""Kernels in TileLang (the optional ``gdn-core[tilelang]`` extra, Hopper only).

Imported only where a launcher runs them: the CPU path and every shape these
kernels do not serve never import TileLang. :func:`available` says whether
TileLang imports here and the device is an sm_90 GPU.
"""

from __future__ import annotations

import functools

__all__ = ["available"]


@functools.cache
def available() -> bool:
    """Whether TileLang imports and the current CUDA device is compute capability 9.0."""
    try:
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            return False
        import tilelang  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True
