"""Input validation shared by the oracle and the chunked implementation.

Every public entry point checks its arguments here before it touches a tensor's
values, so a bad call fails with a message that names the argument, what was
expected and what was given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from gdn_core.chunking import host_offsets

__all__ = ["KDAProblem", "validate_kda_inputs"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class KDAProblem:
    """Sizes and resolved options of one validated call."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    offsets: tuple[int, ...]  # document offsets on the flat token axis, [N+1]
    scale: float
    compute_dtype: torch.dtype  # float64 for float64 inputs (gradcheck), else float32
    device: torch.device

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def group(self) -> int:
        return self.HV // self.H


def _require_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got dtype {x.dtype}"
        )


def _require_ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def _require_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(
            f"{name} is on {x.device} but q is on {device}; all inputs must share a device"
        )


def _check_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device) -> tuple[int, ...]:
    cu = _require_tensor("cu_seqlens", cu_seqlens)
    if cu.dtype not in _INT_DTYPES:
        raise TypeError(f"cu_seqlens must be int32 or int64, got dtype {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}"
        )
    if cu.device.type != "cpu" and cu.device != device:
        raise ValueError(
            f"cu_seqlens is on {cu.device}; it must be on the CPU or on q's device {device}"
        )
    if B != 1:
        raise ValueError(f"cu_seqlens requires a packed batch with B == 1, got B = {B}")
    offs = host_offsets(cu, B, T)
    if offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offs[0]}")
    for a, b in zip(offs[:-1], offs[1:]):
        if b < a:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {a} followed by {b}")
    if offs[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T}, got {offs[-1]}")
    return tuple(offs)


def validate_kda_inputs(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
) -> KDAProblem:
    """Check the KDA inputs; return the sizes and resolved options.

    Raises ``TypeError`` for a wrong type or dtype and ``ValueError`` for a
    wrong shape, head count, device or ``cu_seqlens``.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_tensor(name, x)
        _require_float(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    _require_ndim("q", q, 4, "[B, T, H, K]")
    _require_ndim("k", k, 4, "[B, T, H, K]")
    _require_ndim("v", v, 4, "[B, T, HV, V]")
    if g.dim() == 3:
        raise ValueError(
            f"g must be [B, T, HV, K] (KDA's decay is per channel), got the GDN-style scalar "
            f"gate of shape {tuple(g.shape)}; broadcast it with g[..., None].expand(..., K)"
        )
    _require_ndim("g", g, 4, "[B, T, HV, K]")
    _require_ndim("beta", beta, 3, "[B, T, HV]")
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, HV, V] like q, got {tuple(v.shape)}")
    if H == 0 or K == 0 or V == 0:
        raise ValueError(f"head count and head dims must be positive, got H={H}, K={K}, V={V}")
    if HV == 0 or HV % H != 0:
        raise ValueError(
            f"the number of value heads HV = {HV} (v.shape[2]) must be a positive multiple "
            f"of the number of q/k heads H = {H}"
        )
    if g.shape[:3] != (B, T, HV):
        raise ValueError(f"g must be [B={B}, T={T}, HV={HV}, K={K}], got {tuple(g.shape)}")
    if g.shape[3] != K:
        raise ValueError(
            f"g's trailing dim must equal the key dim K = {K} (one decay per key channel), "
            f"got g of shape {tuple(g.shape)}"
        )
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B={B}, T={T}, HV={HV}], got {tuple(beta.shape)}")
    device = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_device(name, x, device)

    if cu_seqlens is None:
        offsets = tuple(b * T for b in range(B + 1))
    else:
        offsets = _check_cu_seqlens(cu_seqlens, B, T, device)
    N = len(offsets) - 1

    if initial_state is not None:
        _require_tensor("initial_state", initial_state)
        _require_float("initial_state", initial_state)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must be [N={N}, HV={HV}, K={K}, V={V}] (one state per "
                f"sequence), got {tuple(initial_state.shape)}"
            )
        _require_device("initial_state", initial_state, device)

    if scale is None:
        scale = K**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")

    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return KDAProblem(
        B=B, T=T, H=H, HV=HV, K=K, V=V, offsets=offsets, scale=float(scale),
        compute_dtype=compute_dtype, device=device,
    )
