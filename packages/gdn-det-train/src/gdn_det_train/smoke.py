"""A tiny CPU forward+backward: the import-independence checker's smoke entry point."""

from __future__ import annotations

import gdn_det_train.api  # noqa: F401 - the public calls are made when their modules load
import gdn_det_train.conv  # noqa: F401
from gdn_det_train.ops import API


def run() -> None:
    """Conv1d, then GDN with the in-kernel gate, autograd and split API, on CPU
    (:meth:`gdn_core.frontend.SingleRankAPI.smoke`)."""
    API.smoke()
