"""World of one on CPU, no process group: the import checker's smoke entry point."""

from __future__ import annotations

from gdn_det_train_kcp.ops import API


def run() -> None:
    """A tiny conv + KCP GDN forward/backward at world_size 1, checked against the
    single-rank path (:meth:`gdn_core.kcp_frontend.KCPAPI.smoke`)."""
    API.smoke()
