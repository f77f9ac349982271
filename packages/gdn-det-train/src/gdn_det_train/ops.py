"""The package's ``torch.library`` custom ops (namespace ``gdn_det_train``).

``torch.ops.gdn_det_train.chunk_gated_delta_rule`` / ``…_bwd`` and
``torch.ops.gdn_det_train.causal_conv1d`` / ``…_bwd``, built by
:func:`gdn_core.train_ops.define_train_ops` in this package's mode
(deterministic=True).
:func:`gdn_det_train.chunk_gated_delta_rule_det` and
:func:`gdn_det_train.causal_conv1d_det` route
through them, so ``torch.compile(fullgraph=True)`` traces a layer calling them
without a graph break and AOTAutograd sees the registered backward.
"""

from __future__ import annotations

from gdn_core.train_ops import TrainOps, define_train_ops

__all__ = ["OPS"]

OPS: TrainOps = define_train_ops("gdn_det_train", deterministic=True)
