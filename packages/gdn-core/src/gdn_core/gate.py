"""The GDN gate ``g = −exp(A_log) · softplus(g_raw + dt_bias)`` and its backward.

``g_raw: [B,T,HV]`` is the raw per-token gate input, ``A_log, dt_bias: [HV]``
are per-head parameters. The gradients of ``A_log`` and ``dt_bias`` are
reductions over all tokens; with ``deterministic=True`` they are computed by
:func:`ordered_token_sum`: per-block partial sums over a fixed token grid, then
the partials added one after another in block order, so the bits depend only
on the inputs (never on scheduling or atomics).

Also home of the small fixed-order reduction helpers the conv1d backward uses
(:func:`token_block_partials`, :func:`sum_partials_in_order`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "TOKEN_BLOCK",
    "gate_fwd",
    "gate_bwd",
    "GateFunction",
    "gdn_gate",
    "ordered_token_sum",
    "token_block_partials",
    "sum_partials_in_order",
    "validate_gate_params",
]

# Tokens per partial sum of the fixed-order reductions. A constant (not a
# function of the problem size or the device), so the block grid of a token
# axis is always the same.
TOKEN_BLOCK = 1024

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def token_block_partials(x: torch.Tensor, block: int = TOKEN_BLOCK) -> torch.Tensor:
    """Partial sums of ``x: [N, *rest]`` over consecutive blocks of ``block`` tokens.

    Returns ``[ceil(N / block), *rest]`` in ``x``'s dtype; the last block may be
    short. Each partial is one ``torch.sum`` over a contiguous block (a
    deterministic reduction for a fixed shape).
    """
    n = x.shape[0]
    n_full = n // block
    parts = []
    if n_full:
        parts.append(x[: n_full * block].reshape(n_full, block, *x.shape[1:]).sum(1))
    if n - n_full * block:
        parts.append(x[n_full * block :].sum(0, keepdim=True))
    if not parts:
        return x.new_zeros(0, *x.shape[1:])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def sum_partials_in_order(partials: torch.Tensor) -> torch.Tensor:
    """``partials[0] + partials[1] + ...`` added strictly left to right."""
    if partials.shape[0] == 0:
        return partials.new_zeros(partials.shape[1:])
    out = partials[0].clone()
    for i in range(1, partials.shape[0]):
        out += partials[i]
    return out


def ordered_token_sum(
    x: torch.Tensor, deterministic: bool, block: int = TOKEN_BLOCK
) -> torch.Tensor:
    """Sum of ``x: [N, *rest]`` over its first (token) axis.

    ``deterministic=True``: fixed block grid, partials summed in block order.
    Otherwise a single ``torch.sum`` (whatever order the backend picks).
    """
    if deterministic:
        return sum_partials_in_order(token_block_partials(x, block))
    return x.sum(0)


def validate_gate_params(
    g: torch.Tensor, A_log: object, dt_bias: object, HV: int | None = None
) -> None:
    """Check ``A_log`` and ``dt_bias`` (``[HV]`` float tensors on ``g``'s device).

    Raises ``TypeError`` for a non-tensor or an unsupported dtype, ``ValueError``
    for a shape or device mismatch; messages name the public arguments.
    """
    if HV is None:
        HV = g.shape[-1]
    for name, p in (("A_log", A_log), ("dt_bias", dt_bias)):
        if p is None:
            raise ValueError(f"use_gate_in_kernel=True needs {name} (a [HV={HV}] tensor), got None")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
        if p.dtype not in _FLOATS:
            raise TypeError(f"{name} has dtype {p.dtype}; expected a floating dtype")
        if tuple(p.shape) != (HV,):
            raise ValueError(f"{name} must have shape ({HV},) (one per value head), got "
                             f"{tuple(p.shape)}")
        if p.device != g.device:
            raise ValueError(f"{name} is on {p.device}, but g is on {g.device}")


def gate_fwd(
    g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> torch.Tensor:
    """``−exp(A_log) · softplus(g_raw + dt_bias)`` in fp32 (fp64 for fp64 input).

    ``g_raw: [..., HV]``, ``A_log, dt_bias: [HV]``; returns ``g_raw``'s shape.
    """
    dt = _compute_dtype(g_raw, A_log, dt_bias)
    z = g_raw.to(dt) + dt_bias.to(dt)
    return -A_log.to(dt).exp() * F.softplus(z)


def gate_bwd(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    dg: torch.Tensor,
    *,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`gate_fwd` given ``dg`` (gradient of the gate output).

    Returns ``(dg_raw in g_raw's dtype, dA_log in A_log's dtype, ddt_bias in
    dt_bias's dtype)``. The parameter gradients sum over every token (all axes
    but the last), in fixed order when ``deterministic``.
    """
    dt = _compute_dtype(g_raw, A_log, dt_bias)
    HV = g_raw.shape[-1]
    z = g_raw.to(dt) + dt_bias.to(dt)
    a = A_log.to(dt).exp()
    sp = F.softplus(z)
    dgc = dg.to(dt)
    # softplus'(z) = sigmoid(z); torch's softplus switches to the identity above
    # z > 20, where sigmoid(z) rounds to 1 in fp32 as well.
    dz = dgc * (-a) * torch.where(z > 20, torch.ones_like(z), torch.sigmoid(z))
    dA = -(dgc * a * sp)  # d/dA_log of −exp(A_log)·sp = g
    dA_log = ordered_token_sum(dA.reshape(-1, HV), deterministic)
    ddt_bias = ordered_token_sum(dz.reshape(-1, HV), deterministic)
    return dz.to(g_raw.dtype), dA_log.to(A_log.dtype), ddt_bias.to(dt_bias.dtype)


class GateFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`gate_fwd` / :func:`gate_bwd`."""

    @staticmethod
    def forward(ctx, g_raw, A_log, dt_bias, deterministic: bool):  # noqa: D401
        ctx.save_for_backward(g_raw, A_log, dt_bias)
        ctx.deterministic = deterministic
        return gate_fwd(g_raw, A_log, dt_bias)

    @staticmethod
    def backward(ctx, dg):
        g_raw, A_log, dt_bias = ctx.saved_tensors
        dg_raw, dA_log, ddt_bias = gate_bwd(
            g_raw, A_log, dt_bias, dg, deterministic=ctx.deterministic
        )
        return dg_raw, dA_log, ddt_bias, None


def gdn_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Differentiable ``−exp(A_log) · softplus(g_raw + dt_bias)`` (see :func:`gate_bwd`)."""
    if not isinstance(g_raw, torch.Tensor):
        raise TypeError(f"g must be a torch.Tensor, got {type(g_raw).__name__}")
    validate_gate_params(g_raw, A_log, dt_bias)
    return GateFunction.apply(g_raw, A_log, dt_bias, deterministic)
