"""The output norm of a GDN layer: RMSNorm per head, optionally gated by ``silu(gate)``.

``y = weight · x / sqrt(mean(x²) + eps) · act(gate)`` over the last dimension,
computed in fp32 and returned in ``x``'s dtype (``act``: SiLU, or sigmoid).
CUDA tensors (and CPU ones under ``TRITON_INTERPRET=1``) run the fused Triton
kernels of :mod:`gdn_core.layers.norm_kernel`; otherwise (or with
``GDN_CORE_BACKEND=reference``, or fp64) plain torch ops. Both are
deterministic for a fixed shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_core.switches import env_value

__all__ = ["GATE_ACTIVATIONS", "GatedRMSNorm", "rms_norm_gated", "rms_norm_gated_torch"]

GATE_ACTIVATIONS = ("silu", "swish", "sigmoid")


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    activation: str = "silu",
) -> torch.Tensor:
    """RMS-normalise ``x`` over its last dimension, scale by ``weight``, multiply by
    ``act(gate)`` (skipped when ``gate`` is ``None``). Shapes: ``gate`` like ``x``,
    ``weight [x.shape[-1]]``."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
    if _use_kernel(x):
        from gdn_core.layers.norm_kernel import GatedRMSNormFunction

        return GatedRMSNormFunction.apply(x, gate, weight, eps, activation)
    return rms_norm_gated_torch(x, gate, weight, eps, activation)


def _use_kernel(x: torch.Tensor) -> bool:
    if env_value("GDN_CORE_BACKEND") == "reference" or x.dtype == torch.float64:
        return False
    return x.is_cuda or env_value("TRITON_INTERPRET") == "1"


def rms_norm_gated_torch(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor,
                         eps: float, activation: str = "silu") -> torch.Tensor:
    """:func:`rms_norm_gated` in plain torch ops (the reference of the kernels)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if gate is not None:
        gf = gate.float()
        y = y * (torch.sigmoid(gf) if activation == "sigmoid" else F.silu(gf))
    return y.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """:func:`rms_norm_gated` with its ``weight [hidden_size]`` (initialised to ones)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "silu",
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm_gated(x, gate, self.weight, self.eps, self.activation)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}"
