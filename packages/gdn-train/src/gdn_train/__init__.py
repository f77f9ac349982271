"""Single-rank Gated DeltaNet training, non-deterministic and as fast as possible.

The kernels may use atomics and autotuning: results match the fp32 reference
within tolerance but may differ in the last bits from run to run (use
``gdn_det_train`` for bitwise-repeatable training). CUDA tensors run the
Triton kernels of ``gdn_core``; CPU tensors run its fp32 torch reference (or
the Triton interpreter with ``TRITON_INTERPRET=1``).

* :func:`chunk_gated_delta_rule` — differentiable GDN (autograd).
* :func:`chunk_gdn_fwd` / :func:`chunk_gdn_bwd` with :class:`SavedSet`,
  :class:`Workspace`, :class:`Grads` — the split API for frameworks that drive
  forward and backward themselves.
* :func:`causal_conv1d` — the short convolution in front of the kernel.
"""

from gdn_core.layout import VarlenLayout

from gdn_train._typed import Grads, SavedSet, Workspace
from gdn_train.api import chunk_gated_delta_rule, chunk_gdn_bwd, chunk_gdn_fwd
from gdn_train.conv import causal_conv1d
from gdn_train.integrations import restore_transformers, use_in_transformers
from gdn_train.layers import GatedDeltaNet

__version__ = "0.1.0"

__all__ = [
    "GatedDeltaNet",
    "VarlenLayout",
    "restore_transformers",
    "use_in_transformers",
    "Grads",
    "SavedSet",
    "Workspace",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "chunk_gdn_bwd",
    "chunk_gdn_fwd",
]

# Zero-argument entry points the import-independence checker runs.
__smoke__ = ["gdn_train.smoke:run"]
