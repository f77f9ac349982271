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

:func:`fold_chain` runs many chains of such steps at once (the segment path,
:mod:`gdn_core.segment`): each step is exactly one :func:`fold_step` — the
same expression per element, so the same bits — whichever chain, batch or
launch it belongs to. On CUDA one kernel walks every chain (one program per
chain, head and column block, the running state re-read from its output
row); elsewhere the torch loop batches the ``t``-th steps of all chains.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.ops.registry import launcher

__all__ = ["FOLD_IMPLS", "fold_chain", "fold_step", "resolve_fold_impl"]

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


# ------------------------------------------------------------------ chains --


@triton.jit
def _kcp_fold_chain_kernel(
    E, M, O, items, prev, dst, chain_ptr,
    s_ep, s_eh, s_ek, s_mp, s_mh, s_mk,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_c = tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_s = o_k[:, None] * V + o_v[None, :]
    t0 = tl.load(chain_ptr + i_c)
    t1 = tl.load(chain_ptr + i_c + 1)
    for t in range(t0, t1):
        it = tl.load(items + t).to(tl.int64)
        pv = tl.load(prev + t).to(tl.int64)
        ds = tl.load(dst + t).to(tl.int64)
        e = tl.load(E + it * s_ep + i_h * s_eh + o_k[:, None] * s_ek + o_v[None, :],
                    mask=m_kv, other=0.0)
        if pv < 0:
            acc = e
        else:
            p_m = M + it * s_mp + i_h * s_mh
            p_s = O + (pv * HV + i_h) * K * V
            acc = tl.zeros([BK, BV], dtype=tl.float32)
            for j in tl.static_range(K):
                if TRANSPOSE:
                    a = tl.load(p_m + j * s_mk + o_k, mask=m_k, other=0.0)  # M[j, :]
                else:
                    a = tl.load(p_m + o_k * s_mk + j, mask=m_k, other=0.0)  # M[:, j]
                s = tl.load(p_s + j * V + o_v, mask=m_v, other=0.0)  # S[j, :]
                acc = acc + a[:, None] * s[None, :]
            acc = acc + e
        tl.store(O + (ds * HV + i_h) * K * V + off_s, acc, mask=m_kv)
        tl.debug_barrier()  # the next step reads this row back


def fold_chain_config(K: int, V: int) -> dict[str, int]:
    """Pinned launch configuration of the chain kernel (the bits do not depend on it:
    every output element is its own sequential sum). The chain is latency-bound —
    one program per (column block, head, chain) walks all its steps — so the
    blocks are narrow: more programs, fewer products per thread and step."""
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 8 if BK >= 128 else 16)
    return {"BK": BK, "BV": BV, "num_warps": 4}


@launcher(uses_atomics=False, kernels=(_kcp_fold_chain_kernel,))
def _fold_chain_triton(E, M, out, items, prev, dst, ptr, transpose):
    P, HV, K, V = E.shape
    dev = out.device

    def t(x):
        return torch.tensor(x, dtype=torch.int32).to(dev, non_blocking=True)

    cfg = fold_chain_config(K, V)
    n_chains = len(ptr) - 1
    _kcp_fold_chain_kernel[(triton.cdiv(V, cfg["BV"]), HV, n_chains)](
        E, M, out, t(items), t(prev), t(dst), t(ptr),
        E.stride(0), E.stride(1), E.stride(2), M.stride(0), M.stride(1), M.stride(2),
        HV, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"], TRANSPOSE=transpose,
        num_warps=cfg["num_warps"], num_stages=1, enable_fp_fusion=False,
    )


def _fold_chain_torch(E, M, out, items, prev, dst, ptr, transpose):
    P, HV, K, V = E.shape
    dev = out.device
    lengths = [b - a for a, b in zip(ptr[:-1], ptr[1:])]
    for level in range(max(lengths, default=0)):
        steps = [a + level for a, n in zip(ptr[:-1], lengths) if n > level]
        copy = [s for s in steps if prev[s] < 0]
        fold = [s for s in steps if prev[s] >= 0]
        if copy:
            src = torch.tensor([items[s] for s in copy], device=dev)
            out[torch.tensor([dst[s] for s in copy], device=dev)] = E[src]
        if fold:
            src = torch.tensor([items[s] for s in fold], device=dev)
            n = len(fold)
            Ms = M[src].reshape(n * HV, K, K)
            Ss = out[torch.tensor([prev[s] for s in fold], device=dev)].reshape(n * HV, K, V)
            Es = E[src].reshape(n * HV, K, V)
            res = _fold_torch(Ms, Ss, Es, transpose).reshape(n, HV, K, V)
            out[torch.tensor([dst[s] for s in fold], device=dev)] = res


def fold_chain(
    E: torch.Tensor,
    M: torch.Tensor,
    out: torch.Tensor,
    items: list[int] | tuple[int, ...],
    prev: list[int] | tuple[int, ...],
    dst: list[int] | tuple[int, ...],
    chain_ptr: list[int] | tuple[int, ...],
    *,
    transpose: bool = False,
    impl: str | None = None,
) -> torch.Tensor:
    """Run chains of fold steps, writing ``out`` in place; returns ``out``.

    ``E: [P,HV,K,V]`` and ``M: [P,HV,K,K]`` (views allowed; unit stride in the
    last dimension) are the summary pool; ``out: [R,HV,K,V]`` contiguous holds
    the seeds (written by the caller) and receives every step's result. Step
    ``s`` (host lists ``items``, ``prev``, ``dst``; the steps of chain ``c`` are
    ``chain_ptr[c] .. chain_ptr[c+1]-1``, in order)::

        out[dst[s]] = E[items[s]]                                   if prev[s] < 0
        out[dst[s]] = fold_step(M[items[s]], out[prev[s]], E[items[s]], transpose)

    ``prev[s]`` must be a seed row or the ``dst`` of an earlier step of the
    same chain; distinct chains must not share rows. Every step gives exactly
    :func:`fold_step`'s bits, whatever the number of chains or steps.
    """
    if E.dim() != 4 or M.dim() != 4 or out.dim() != 4:
        raise ValueError("fold_chain needs E [P,HV,K,V], M [P,HV,K,K] and out [R,HV,K,V]")
    P, HV, K, V = E.shape
    if tuple(M.shape) != (P, HV, K, K) or tuple(out.shape[1:]) != (HV, K, V):
        raise ValueError(f"fold_chain shapes disagree: E {tuple(E.shape)}, M {tuple(M.shape)}, "
                         f"out {tuple(out.shape)}")
    if M.dtype != E.dtype or out.dtype != E.dtype:
        raise TypeError("fold_chain needs E, M and out of one dtype")
    if not out.is_contiguous() or E.stride(-1) != 1 or M.stride(-1) != 1:
        raise ValueError("fold_chain needs a contiguous out and unit-stride rows of E and M")
    if not (len(items) == len(prev) == len(dst) == (chain_ptr[-1] if chain_ptr else 0)):
        raise ValueError("fold_chain: items, prev, dst and chain_ptr disagree")
    if not items or HV == 0:
        return out
    chosen = resolve_fold_impl(out.device, out.dtype, impl)
    args = (E, M, out, list(items), list(prev), list(dst), list(chain_ptr), bool(transpose))
    if chosen == "triton":
        _fold_chain_triton(*args)
    else:
        _fold_chain_torch(*args)
    return out
