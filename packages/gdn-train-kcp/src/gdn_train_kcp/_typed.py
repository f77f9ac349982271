"""The non-deterministic KCP package's typed classes: plan, context, saved set,
gradients, workspace (made by :func:`gdn_core.package_types.kcp_types`: this
package's own)."""

from __future__ import annotations

from gdn_core.package_types import kcp_types

__all__ = ["KCPPlan", "KCPContext", "KCPSavedSet", "KCPGrads", "KCPWorkspace"]

KCPPlan, KCPContext, KCPSavedSet, KCPGrads, KCPWorkspace = kcp_types(
    "gdn_train_kcp", deterministic=False)
