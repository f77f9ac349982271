"""The package's public calls and ``torch.library`` custom ops (namespace ``gdn_train_kcp``).

``torch.ops.gdn_train_kcp.kcp_*``, built by :func:`gdn_core.kcp_ops.define_kcp_ops` in
this package's mode (deterministic=False); :data:`API`
(:class:`gdn_core.kcp_frontend.KCPAPI`) makes the public functions, and the
differentiable ones route through the ops (``torch.compile(fullgraph=True)``
traces them whole).
"""

from __future__ import annotations

from gdn_core.kcp_frontend import KCPAPI

from gdn_train_kcp._typed import KCPContext, KCPGrads, KCPPlan, KCPSavedSet, KCPWorkspace

__all__ = ["API"]

API = KCPAPI("gdn_train_kcp", deterministic=False, plan_cls=KCPPlan, context_cls=KCPContext,
             saved_cls=KCPSavedSet, workspace_cls=KCPWorkspace, grads_cls=KCPGrads)
