"""The output norm of a GDN layer: RMSNorm per head, optionally gated by ``silu(gate)``.

``y = weight · x / sqrt(mean(x²) + eps) · act(gate)`` over the last dimension,
computed in fp32 and returned in ``x``'s dtype (``act``: SiLU, or sigmoid).
Plain torch: per-row reductions and elementwise ops, deterministic for a fixed
shape on CPU and CUDA (the weight's gradient is autograd's sum over rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GATE_ACTIVATIONS", "GatedRMSNorm", "rms_norm_gated"]

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
