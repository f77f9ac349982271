"""The deterministic KCP package's typed classes: plan, context, saved set, gradients,
workspace (made by :func:`gdn_core.package_types.kcp_types`: this package's own)."""

from __future__ import annotations

from gdn_core.package_types import kcp_types

__all__ = ["DetKCPPlan", "DetKCPContext", "DetKCPSavedSet", "DetKCPGrads", "DetKCPWorkspace"]

DetKCPPlan, DetKCPContext, DetKCPSavedSet, DetKCPGrads, DetKCPWorkspace = kcp_types(
    "gdn_det_train_kcp", deterministic=True)
