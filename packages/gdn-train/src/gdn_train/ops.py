"""The package's ``torch.library`` custom ops (namespace ``gdn_train``).

``torch.ops.gdn_train.chunk_gated_delta_rule`` / ``…_bwd`` and
``torch.ops.gdn_train.causal_conv1d`` / ``…_bwd``, built by
:func:`gdn_core.train_ops.define_train_ops` in this package's mode
(deterministic=False).
:func:`gdn_train.chunk_gated_delta_rule` and
:func:`gdn_train.causal_conv1d` route
through them, so ``torch.compile(fullgraph=True)`` traces a layer calling them
without a graph break and AOTAutograd sees the registered backward.
"""

from __future__ import annotations

from gdn_core.train_ops import TrainOps, define_train_ops

__all__ = ["OPS"]

OPS: TrainOps = define_train_ops("gdn_train", deterministic=False)
