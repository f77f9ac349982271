"""Input validation for every public GDN entry point.

All checks run before any kernel launch or allocation, so rejected input
leaves nothing written. Errors name the public argument, what it got and what
was expected: ``TypeError`` for wrong types/dtypes, ``ValueError`` for wrong
shapes, values or devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gdn_core.chunking import host_offsets, require_int_entries

__all__ = ["GDNShapes", "MAX_HEAD_DIM", "SUPPORTED_DTYPES", "check_bool", "check_input_values",
           "validate_gdn_inputs"]

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_REFERENCE_ONLY_DTYPES = (torch.float64,)


@dataclass(frozen=True)
class GDNShapes:
    """Validated problem size. ``offsets``: host document offsets on the flat token axis;
    ``group`` (``HV // H``) and ``num_docs`` are plain attributes, set once."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    offsets: tuple[int, ...]
    group: int = field(init=False)
    num_docs: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", self.HV // self.H)
        object.__setattr__(self, "num_docs", len(self.offsets) - 1)


def _require_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _check_float(name: str, x: torch.Tensor, allow_float64: bool) -> None:
    allowed = SUPPORTED_DTYPES + (_REFERENCE_ONLY_DTYPES if allow_float64 else ())
    if x.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} has dtype {x.dtype}; expected one of {names}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor | list[int], B: int, T: int,
                      device: torch.device | None = None) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens has dtype {cu_seqlens.dtype}; expected int32 or int64")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device}; expected the CPU or the "
                             f"inputs' device {device}")
    elif isinstance(cu_seqlens, (list, tuple)):
        require_int_entries(cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens must be a tensor, a list of ints or None, got "
                        f"{type(cu_seqlens).__name__}")
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size B == 1 (packed documents), got B={B}")
    offs = host_offsets(cu_seqlens, B, T)
    if len(offs) < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 entries [0, ..., T], got {offs}")
    if offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offs[0]}")
    for i in range(1, len(offs)):
        if offs[i] < offs[i - 1]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}]={offs[i]} < "
                f"cu_seqlens[{i - 1}]={offs[i - 1]}"
            )
    if offs[-1] != T:
        raise ValueError(f"cu_seqlens must end at T={T} (the packed length), got {offs[-1]}")
    return offs


def validate_gdn_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    gate_channels: bool = False,
    allow_float64: bool = False,
) -> GDNShapes:
    """Check the GDN (or, with ``gate_channels=True``, KDA) inputs and return their sizes.

    Expected: ``q, k: [B,T,H,K]`` of one dtype, ``v: [B,T,HV,V]`` of that dtype,
    ``g: [B,T,HV]`` (``[B,T,HV,K]`` if ``gate_channels``), ``beta: [B,T,HV]``,
    ``HV % H == 0``, K and V multiples of 16 up to 256, everything on one device,
    ``initial_state: [N,HV,K,V]`` float, ``cu_seqlens: [N+1]`` int (``B == 1``).

    Raises:
        TypeError: a non-tensor argument, an unsupported dtype, a ``scale`` that is
            not a number (a bool is not), a ``cu_seqlens`` list entry that is not an int.
        ValueError: a shape, head-count (``H`` or ``HV`` zero included), ``cu_seqlens``
            or device mismatch (``cu_seqlens`` on neither the CPU nor the inputs'
            device, e.g. ``meta``), a non-finite ``scale``.

    A list ``cu_seqlens`` must hold ints (``TypeError`` for ``3.7`` or ``3.0``).
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_tensor(name, x)
        _check_float(name, x, allow_float64)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, HV, V], got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV == 0 or HV % H != 0:
        raise ValueError(
            f"the value heads HV={HV} (v.shape[2]) must be a positive multiple of the "
            f"q/k heads H={H} (q.shape[2])"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    g_shape = (B, T, HV, K) if gate_channels else (B, T, HV)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"g must have shape {g_shape}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must have shape {(B, T, HV)}, got {tuple(beta.shape)}")
    for dim_name, d in (("K (q.shape[3])", K), ("V (v.shape[3])", V)):
        if d % 16 != 0 or not 16 <= d <= MAX_HEAD_DIM:
            raise ValueError(
                f"head dimension {dim_name} = {d} is unsupported; expected a multiple of 16 "
                f"between 16 and {MAX_HEAD_DIM}"
            )
    devices = {x.device for x in (q, k, v, g, beta)}
    if initial_state is not None:
        _require_tensor("initial_state", initial_state)
        devices.add(initial_state.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__} "
                            f"{scale!r}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be a finite float or None, got {scale!r}")

    if cu_seqlens is not None:
        offs = _check_cu_seqlens(cu_seqlens, B, T, q.device)
    else:
        offs = host_offsets(None, B, T)
    N = len(offs) - 1
    if initial_state is not None:
        _check_float("initial_state", initial_state, allow_float64=True)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must have shape [N={N}, HV={HV}, K={K}, V={V}] (one state per "
                f"sequence), got {tuple(initial_state.shape)}"
            )
    return GDNShapes(B=B, T=T, H=H, HV=HV, K=K, V=V, offsets=tuple(offs))


def check_bool(name: str, flag: object) -> bool:
    """``flag`` if it is a bool, else ``TypeError`` (``"no"`` would switch an option on)."""
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    return flag


def _value_at(name: str, x: torch.Tensor, bad: torch.Tensor, rule: str) -> str:
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return f"{name} {rule}, got {name}[{', '.join(map(str, idx))}] = {float(x[idx])!r}"


def check_input_values(
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> str | None:
    """The message of the first value outside the recurrence's domain, or ``None``.

    The opt-in check of the GDN calls' ``check_inputs=True`` (one host
    synchronisation; off by default, so the hot path never reads a value):

    * ``g`` (the log-decay) must be ``<= 0``: ``g > 0`` (a growing state) and NaN
      are refused; ``-inf`` is allowed, a full reset
      (:data:`gdn_core.chunking.MIN_LOG_DECAY`);
    * with ``use_gate_in_kernel`` ``g`` is the raw gate input (any real number, the
      decay ``−exp(A_log)·softplus(g + dt_bias)`` is ``<= 0`` by construction): only a
      NaN is refused there, and a non-finite ``A_log`` / ``dt_bias``;
    * ``beta`` must lie in ``[0, 1]`` (NaN refused).

    The message names the tensor, the first offending index and its value.
    """
    rules: list[tuple[str, torch.Tensor, torch.Tensor, str]] = []
    if use_gate_in_kernel:
        rules.append(("g", g, torch.isnan(g), "must not be NaN (the raw gate input)"))
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None:
                rules.append((name, t, ~torch.isfinite(t), "must be finite"))
    else:
        rules.append(("g", g, ~(g <= 0),
                      "must be <= 0 (a log-decay; -inf is a full reset)"))
    rules.append(("beta", beta, ~((beta >= 0) & (beta <= 1)), "must lie in [0, 1]"))
    found = torch.stack([bad.any() for _, _, bad, _ in rules]).tolist()  # one sync
    for hit, (name, x, bad, rule) in zip(found, rules):
        if hit:
            return _value_at(name, x, bad, rule)
    return None
