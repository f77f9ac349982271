"""The Gated DeltaNet layer (``torch.nn.Module``) and its state-dict converters.

* :class:`SingleRankGatedDeltaNet` — one process, packed documents, initial and
  final state; the training packages bind their kernels to it
  (``gdn_train.GatedDeltaNet``, ``gdn_det_train.GatedDeltaNet``).
* :class:`ContextParallelGatedDeltaNet` — one rank's shard, taking the rank's
  context (``gdn_train_kcp.GatedDeltaNetKCP``, ``gdn_det_train_kcp.GatedDeltaNetKCP``).
* :mod:`gdn_core.layers.qwen3_next` — transformers' Qwen3-Next layout ↔ ours;
  fla's ``GatedDeltaNet`` state dict loads unchanged.

See ``docs/layer.md``.
"""

from gdn_core.layers.gated_deltanet import (
    ContextParallelGatedDeltaNet,
    GatedDeltaNetBase,
    ShortConv,
    SingleRankGatedDeltaNet,
)
from gdn_core.layers.norm import GatedRMSNorm, rms_norm_gated
from gdn_core.layers.qwen3_next import (
    from_qwen3_next_state_dict,
    qwen3_next_layer_kwargs,
    to_qwen3_next_state_dict,
)

__all__ = [
    "ContextParallelGatedDeltaNet",
    "GatedDeltaNetBase",
    "GatedRMSNorm",
    "ShortConv",
    "SingleRankGatedDeltaNet",
    "from_qwen3_next_state_dict",
    "qwen3_next_layer_kwargs",
    "rms_norm_gated",
    "to_qwen3_next_state_dict",
]
