"""On/off environment switches of the kernel pipeline (read at each call).

Each switch selects between two kernel paths that keep the determinism contract; the
variable holds ``1`` (on), ``0`` (off) or nothing (the switch's default). Any other value
raises, so that a typo never silently leaves the other path in place.
"""

from __future__ import annotations

import os

__all__ = ["FUSED_FWD_ENV", "switch_setting"]

#: the forward's last phase (state recurrence and output) as one kernel (default: on where
#: measured, :func:`gdn_core.segment.fused_fwd_wanted`)
FUSED_FWD_ENV = "GDN_CORE_FUSED_FWD"


def switch_setting(name: str) -> bool | None:
    """``True`` / ``False`` where the environment variable ``name`` is ``1`` / ``0``;
    ``None`` where it is unset or empty (the caller's default).

    Raises:
        ValueError: it is set to anything else.
    """
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return None if raw == "" else raw == "1"

