"""Single-rank Gated DeltaNet training with bitwise-deterministic gradients.

Identical inputs on the same device type give identical bits — outputs and
every gradient — across repeated calls and across processes: no atomics, no
run-time autotuning, fixed-order reductions. CUDA tensors run the Triton
kernels of ``gdn_core``; CPU tensors run its fp32 torch reference (or the
Triton interpreter with ``TRITON_INTERPRET=1``).

* :func:`chunk_gated_delta_rule_det` — differentiable GDN (autograd).
* :func:`chunk_gdn_det_fwd` / :func:`chunk_gdn_det_bwd` with
  :class:`DetSavedSet`, :class:`DetWorkspace`, :class:`DetGrads` — the split
  API for frameworks that drive forward and backward themselves.
* :class:`VarlenLayout` — documents with fixed-size device tables
  (``cu_seqlens=`` for ``torch.compile`` and CUDA graphs, see
  :mod:`gdn_core.layout`).
* :func:`causal_conv1d_det` — the short convolution in front of the kernel.
"""

from gdn_core.layout import VarlenLayout

from gdn_det_train._typed import DetGrads, DetSavedSet, DetWorkspace
from gdn_det_train.api import chunk_gated_delta_rule_det, chunk_gdn_det_bwd, chunk_gdn_det_fwd
from gdn_det_train.conv import causal_conv1d_det
from gdn_det_train.integrations import restore_transformers, use_in_transformers
from gdn_det_train.layers import GatedDeltaNet

__version__ = "0.1.0"

__all__ = [
    "GatedDeltaNet",
    "VarlenLayout",
    "restore_transformers",
    "use_in_transformers",
    "DetGrads",
    "DetSavedSet",
    "DetWorkspace",
    "causal_conv1d_det",
    "chunk_gated_delta_rule_det",
    "chunk_gdn_det_bwd",
    "chunk_gdn_det_fwd",
]

# Zero-argument entry points the import-independence checker runs.
__smoke__ = ["gdn_det_train.smoke:run"]
