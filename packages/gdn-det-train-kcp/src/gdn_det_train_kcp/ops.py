"""The package's public calls and ``torch.library`` custom ops (namespace ``gdn_det_train_kcp``).

``torch.ops.gdn_det_train_kcp.kcp_*``, built by :func:`gdn_core.kcp_ops.define_kcp_ops` in
this package's mode (deterministic=True); :data:`API`
(:class:`gdn_core.kcp_frontend.KCPAPI`) makes the public functions, and the
differentiable ones route through the ops (``torch.compile(fullgraph=True)``
traces them whole).
"""

from __future__ import annotations

from gdn_core.kcp_frontend import KCPAPI

from gdn_det_train_kcp._typed import (
             DetKCPContext,
             DetKCPGrads,
             DetKCPPlan,
             DetKCPSavedSet,
             DetKCPWorkspace,
)

__all__ = ["API"]

API = KCPAPI("gdn_det_train_kcp", deterministic=True, plan_cls=DetKCPPlan,
             context_cls=DetKCPContext, saved_cls=DetKCPSavedSet,
             workspace_cls=DetKCPWorkspace, grads_cls=DetKCPGrads)
