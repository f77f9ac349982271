"""TileLang kernels: the optional Hopper backend of :mod:`gdn_core.ops` (``gdn-core[tilelang]``).

Only this subpackage imports ``tilelang``; nothing on the CPU path or in
:mod:`gdn_core.ops` imports it. :func:`available` says whether it can run here
(TileLang importable and an sm_90 GPU present). Why TileLang, with the
measurements: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["available"]


@functools.cache
def available() -> bool:
    """``True`` when ``tilelang`` imports and the current CUDA device is Hopper (sm_90)."""
    if importlib.util.find_spec("tilelang") is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() == (9, 0)
