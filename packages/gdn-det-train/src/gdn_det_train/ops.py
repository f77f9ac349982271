"""The package's public calls and ``torch.library`` custom ops (namespace ``gdn_det_train``).

``torch.ops.gdn_det_train.chunk_gated_delta_rule`` / ``…_bwd`` and
``torch.ops.gdn_det_train.causal_conv1d`` / ``…_bwd``, built by
:func:`gdn_core.train_ops.define_train_ops` in this package's mode
(deterministic=True); :data:`API` makes the public functions that route
through them (:class:`gdn_core.frontend.SingleRankAPI`), so
``torch.compile(fullgraph=True)`` traces a layer calling them without a graph
break and AOTAutograd sees the registered backward.
"""

from __future__ import annotations

from gdn_core.frontend import SingleRankAPI
from gdn_core.train_ops import TrainOps

from gdn_det_train._typed import DetGrads, DetSavedSet, DetWorkspace

__all__ = ["API", "OPS"]

API = SingleRankAPI("gdn_det_train", deterministic=True, saved_cls=DetSavedSet,
                    workspace_cls=DetWorkspace, grads_cls=DetGrads)
OPS: TrainOps = API.ops
