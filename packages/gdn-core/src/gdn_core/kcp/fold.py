"""The fp32 fold of state summaries, in a fixed order, immune to TF32 settings.

One fold step applies a rank's summary to an incoming state, per value head::

    forward:   S_out  = M  S_in  + S_ext        (M: [HV,K,K], S: [HV,K,V])
    backward:  dS_in  = Mᵀ dS_out + dS_ext

Every step is written as an explicit sum of rank-1 terms in a fixed order,
each product and each sum rounded to fp32 on its own::

    acc = 0;  for j in 0..K-1:  acc = acc + M[:, j] ⊗ S[j, :];   out = acc + E

No library matmul is involved, so neither ``torch.backends.cuda.matmul``
(TF32), nor oneDNN's reduced-precision modes, nor cuBLAS' choice of kernel by
batch size can change a bit. Two implementations compute exactly this:

* ``"torch"`` — elementwise torch ops (2·K small kernels per step): the CPU
  path, and the float64 path (``gradcheck``);
* ``"triton"`` — one kernel per step (fp-contraction disabled, so no fused
  multiply-add): the CUDA path. It gives the same bits as the torch loop
  (checked under ``TRITON_INTERPRET=1``).

A chain ``fold_forward(seed, [(M1,E1), (M2,E2), ...])`` applies the steps in
list order; the caller (the KCP composition) fixes the order from the plan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.ops.registry import launcher

__all__ = ["FOLD_IMPLS", "fold_step", "resolve_fold_impl"]

FOLD_IMPLS = ("torch", "triton")


def resolve_fold_impl(device: torch.device, dtype: torch.dtype, impl: str | None = None) -> str:
    """``"triton"`` for fp32 CUDA tensors, else ``"torch"`` (or the explicit ``impl``)."""
    if impl is not None:
        if impl not in FOLD_IMPLS:
            raise ValueError(f"fold impl must be one of {FOLD_IMPLS}, got {impl!r}")
        if impl == "triton" and dtype != torch.float32:
            raise TypeError(f"the triton fold runs fp32 only, got {dtype}")
        return impl
    if device.type == "cuda" and dtype == torch.float32:
        return "triton"
    return "torch"


def _fold_torch(M: torch.Tensor, S: torch.Tensor, E: torch.Tensor | None,
                transpose: bool) -> torch.Tensor:
    K = M.shape[-1]
    acc = torch.zeros_like(S)
    for j in range(K):
        col = M[:, j, :] if transpose else M[:, :, j]  # [HV, K]: Mᵀ[:, j] or M[:, j]
        acc = acc + col[:, :, None] * S[:, j, None, :]
    if E is not None:
        acc = acc + E
    return acc


@triton.jit
def _kcp_fold_kernel(
    M, S, E, O,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    HAS_E: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    p_m = M + i_h * K * K
    p_s = S + i_h * K * V
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    for j in range(K):
        if TRANSPOSE:
            a = tl.load(p_m + j * K + o_k, mask=m_k, other=0.0)  # M[j, :] = Mᵀ[:, j]
        else:
            a = tl.load(p_m + o_k * K + j, mask=m_k, other=0.0)  # M[:, j]
        s = tl.load(p_s + j * V + o_v, mask=m_v, other=0.0)  # S[j, :]
        acc = acc + a[:, None] * s[None, :]
    off = i_h * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    if HAS_E:
        acc = acc + tl.load(E + off, mask=m_kv, other=0.0)
    tl.store(O + off, acc, mask=m_kv)


@launcher(uses_atomics=False, kernels=(_kcp_fold_kernel,))
def _fold_triton(M: torch.Tensor, S: torch.Tensor, E: torch.Tensor | None,
                 transpose: bool) -> torch.Tensor:
    HV, K, V = S.shape
    M, S = M.contiguous(), S.contiguous()
    E = E.contiguous() if E is not None else None
    out = torch.empty_like(S)
    if HV == 0 or K == 0 or V == 0:
        return out
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32 if BK <= 128 else 16)
    _kcp_fold_kernel[(triton.cdiv(V, BV), HV)](
        M, S, E if E is not None else S, out,
        K=K, V=V, BK=BK, BV=BV, TRANSPOSE=transpose, HAS_E=E is not None,
        num_warps=4, num_stages=1, enable_fp_fusion=False,
    )
    return out


def fold_step(
    M: torch.Tensor,
    S: torch.Tensor,
    E: torch.Tensor | None = None,
    *,
    transpose: bool = False,
    impl: str | None = None,
) -> torch.Tensor:
    """``M S + E`` (or ``Mᵀ S + E``) per head, in the fixed order of the module docstring.

    ``M: [HV,K,K]``, ``S, E: [HV,K,V]``, all of one float dtype (fp32; fp64 on
    the torch path) and device. Returns a new ``[HV,K,V]`` tensor.
    """
    if M.dim() != 3 or S.dim() != 3 or M.shape[0] != S.shape[0] or M.shape[1:] != (
        S.shape[1], S.shape[1]
    ):
        raise ValueError(
            f"fold_step needs M [HV,K,K] and S [HV,K,V], got {tuple(M.shape)}, {tuple(S.shape)}"
        )
    if E is not None and E.shape != S.shape:
        raise ValueError(f"E must have S's shape {tuple(S.shape)}, got {tuple(E.shape)}")
    if M.dtype != S.dtype or (E is not None and E.dtype != S.dtype):
        raise TypeError("fold_step needs M, S and E of one dtype")
    chosen = resolve_fold_impl(S.device, S.dtype, impl)
    if chosen == "triton":
        return _fold_triton(M, S, E, transpose)
    return _fold_torch(M, S, E, transpose)
