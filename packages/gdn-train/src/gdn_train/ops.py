"""The package's public calls and ``torch.library`` custom ops (namespace ``gdn_train``).

``torch.ops.gdn_train.chunk_gated_delta_rule`` / ``…_bwd`` and
``torch.ops.gdn_train.causal_conv1d`` / ``…_bwd``, built by
:func:`gdn_core.train_ops.define_train_ops` in this package's mode
(deterministic=False); :data:`API` makes the public functions that route
through them (:class:`gdn_core.frontend.SingleRankAPI`), so
``torch.compile(fullgraph=True)`` traces a layer calling them without a graph
break and AOTAutograd sees the registered backward.
"""

from __future__ import annotations

from gdn_core.frontend import SingleRankAPI
from gdn_core.train_ops import TrainOps

from gdn_train._typed import Grads, SavedSet, Workspace

__all__ = ["API", "OPS"]

API = SingleRankAPI("gdn_train", deterministic=False, saved_cls=SavedSet,
                    workspace_cls=Workspace, grads_cls=Grads)
OPS: TrainOps = API.ops
