"""Switch a transformers model's Gated DeltaNet layers to this package's deterministic kernels.

See :mod:`gdn_core.transformers_switch` and ``docs/transformers.md``.
"""

from __future__ import annotations

import torch
from gdn_core.layers.norm import rms_norm_gated
from gdn_core.transformers_switch import restore_model, switch_model

from gdn_det_train.api import chunk_gated_delta_rule_det
from gdn_det_train.conv import causal_conv1d_det

__all__ = ["restore_transformers", "use_in_transformers"]


def use_in_transformers(model: torch.nn.Module, *, conv: bool = True,
                        norm: bool = True) -> list[str]:
    """Make ``model`` (e.g. transformers' ``Qwen3NextForCausalLM``) run its GDN layers
    on :func:`chunk_gated_delta_rule_det` and, with ``conv``, their short conv on
    :func:`causal_conv1d_det` (both keep packed documents apart by ``cu_seq_lens_q``);
    with ``norm``, their gated RMSNorm on :func:`gdn_core.layers.norm.rms_norm_gated`
    (fused Triton kernels on CUDA).

    Returns the switched layers' names; ``ValueError`` if there are none. Only
    this model is affected; :func:`restore_transformers` undoes it.
    """
    return switch_model(model, gdn=chunk_gated_delta_rule_det,
                        conv=causal_conv1d_det if conv else None,
                        norm=rms_norm_gated if norm else None)


def restore_transformers(model: torch.nn.Module) -> list[str]:
    """Undo :func:`use_in_transformers` → the names of the layers restored."""
    return restore_model(model)
