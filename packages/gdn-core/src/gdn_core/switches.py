"""On/off environment switches of the kernel pipeline (read at each call).

Each switch selects between two kernel paths that keep the determinism contract; the
variable holds ``1`` (on), ``0`` or nothing (off). Any other value raises, so that a typo
never silently leaves the other path in place.
"""

from __future__ import annotations

import os

__all__ = ["FUSED_BWD_ENV", "FUSED_FWD_ENV", "switch_on"]

#: the forward's last phase (state recurrence and output) as one kernel
FUSED_FWD_ENV = "GDN_CORE_FUSED_FWD"
#: the backward's local ``dV'`` and reverse state recurrence as one kernel
FUSED_BWD_ENV = "GDN_CORE_FUSED_BWD"


def switch_on(name: str) -> bool:
    """Whether the environment variable ``name`` is ``1``.

    Raises:
        ValueError: it is set to anything but ``""``, ``0`` or ``1``.
    """
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return raw == "1"
