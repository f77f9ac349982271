"""The non-deterministic mode's saved set, workspace and gradients (made by
:func:`gdn_core.package_types.single_rank_types`: this package's own classes)."""

from __future__ import annotations

from gdn_core.package_types import single_rank_types

__all__ = ["SavedSet", "Workspace", "Grads"]

SavedSet, Workspace, Grads = single_rank_types("gdn_train", deterministic=False)
