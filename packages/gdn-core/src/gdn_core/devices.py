"""Device arguments: refuse a device this process cannot use, with a clear error.

Without the check, asking for ``device="cuda"`` on a machine without CUDA ends
in torch's bare ``AssertionError`` ("Torch not compiled with CUDA enabled") at
the first allocation, far from the argument that caused it.
"""

from __future__ import annotations

import torch

__all__ = ["require_device"]


def require_device(device: torch.device | str | int, argname: str = "device") -> torch.device:
    """``device`` as a :class:`torch.device`, after checking that it can be used here.

    The index is kept as given (``"cuda"`` stays ``cuda`` without an index; an
    int means that CUDA device, as for :class:`torch.device`). Raises
    ``TypeError`` for something that is not a device, a device string or an int,
    ``ValueError`` for an unknown device string, for ``cuda`` when CUDA is not
    available in this process, and for a CUDA index beyond the visible devices.
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{argname} must be a torch.device, a device string or an int, got "
                        f"{type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"{argname}={device!r} is not a device: {err}") from None
    if dev.type == "cuda":
        _require_cuda(dev, argname)
    return dev


def _require_cuda(dev: torch.device, argname: str) -> None:
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "no CUDA device is visible to this process")
        raise ValueError(f"{argname}={str(dev)!r} was given, but CUDA is not available "
                         f"({why}); use device='cpu'")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{argname}={str(dev)!r} was given, but this process sees "
                         f"{count} CUDA device(s)")
