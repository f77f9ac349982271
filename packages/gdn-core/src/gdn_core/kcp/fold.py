"""The fp32 fold of state summaries, in a fixed order, immune to TF32 settings.

One fold step applies a rank's summary to an incoming state, per value head::

    forward:   S_out  = M  S_in  + S_ext        (M: [HV,K,K], S: [HV,K,V])
    backward:  dS_in  = Mᵀ dS_out + dS_ext

Two implementations, each a fixed order of IEEE fp32 (or fp64) operations; no
torch matmul is involved, so neither ``torch.backends.cuda.matmul`` (TF32), nor
oneDNN's reduced-precision modes, nor cuBLAS' choice of kernel by batch size
can change a bit:

* ``"torch"`` — elementwise torch ops, an explicit sum of rank-1 terms, each
  product and each sum rounded on its own (2·K small kernels per step)::

      acc = 0;  for j in 0..K-1:  acc = acc + M[:, j] ⊗ S[j, :];   out = acc + E

  The CPU path, and the float64 path (``gradcheck``).
* ``"triton"`` — the CUDA path: tiled ``tl.dot(..., input_precision="ieee")``
  (fp32 in, fp32 accumulate: never TF32), seeded with ``E``, over fixed
  ``BJ``-wide slices of ``j`` in increasing order::

      acc = E (or 0);  for j0 in 0, BJ, 2·BJ, ...:  acc = dot(M[:, j0:j0+BJ], S[j0:j0+BJ, :], acc)

  On the GPU an fp32 IEEE ``tl.dot`` is a chain of fused multiply-adds per
  output element, in ``j`` order; under ``TRITON_INTERPRET=1`` each slice is a
  numpy matmul added to ``acc``. Either way the triton fold does **not**
  reproduce the torch loop's bits (fused vs separately rounded products): it
  agrees with it to fp32 rounding (about 1e-7 relative per step; the tests
  allow 1e-5).

**The bit contract** is per device type: on one device type, every step gives
the same bits whichever call computes it — :func:`fold_step` or any step of a
:func:`fold_chain`, whatever the number of chains, steps or segments folded in
the same launch (both Triton kernels share one tile routine and one pinned
launch configuration, a function of ``K`` and ``V`` only, and every output
element is its own sequential sum). That is what lets the single-rank segment
path and the context-parallel composition fold alike.

:func:`fold_chain` runs many chains of such steps at once (the segment path,
:mod:`gdn_core.segment`). On CUDA one kernel walks every chain (one program per
column block, head and chain, the running state re-read from its output row);
elsewhere the torch loop batches the ``t``-th steps of all chains.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.hostcache import device_int_tables
from gdn_core.ops.launch import cached_launch
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


def fold_config(K: int, V: int) -> dict[str, int]:
    """The pinned launch configuration of both fold kernels: one function of ``K``
    and ``V``, so :func:`fold_step` and :func:`fold_chain` do the same per-element
    arithmetic.

    ``BJ`` is the slice of ``j`` per ``tl.dot``, ``BU`` the rows of ``j`` whose
    loads are unrolled together, ``BV`` the column block of one program. A chain
    is latency-bound — one program per (column block, head, chain) walks all its
    steps; a column block of the output needs only the same column block of the
    incoming state — so the column blocks are narrow, at ``tl.dot``'s smallest
    width 16 (128 programs for 16 heads at V=128). Four warps up to K=128: the
    FMA issue per SM is the same as with eight, and each thread's larger output
    tile halves the shared-memory operand reads (sm_90, Triton 3.6: the chain
    kernel does not spill; the single-step kernel, which hoists every load,
    spills a little at K=128); eight at K=256, where ``BU`` also caps the
    unrolled loads at 128 rows of ``j``.

    Both launches pin ``enable_fp_fusion=True`` (Triton's default is due to
    change): the only floating-point operations of the kernels are the
    multiply-adds of the fp32 ``tl.dot``, and fusion decides whether they are
    FMAs (one rounding each, half the instructions) or separately rounded
    multiplies and adds. That decides bits, so it is pinned, not inherited.
    """
    BK = max(16, triton.next_power_of_2(K))
    return {
        "BK": BK,
        "BJ": min(BK, 32),
        "BU": min(BK, 128),
        "BV": 16,
        "num_warps": 4 if BK <= 128 else 8,
    }


@triton.jit
def _fold_tile(acc, p_m, s_mk, p_s, o_k, m_k, o_v, m_v,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr,
               BU: tl.constexpr, BV: tl.constexpr, TRANSPOSE: tl.constexpr):
    """``acc + M[:, :K] @ S[:K, cols]`` (or ``Mᵀ``): IEEE fp32 dots over ``BJ``-wide
    slices of ``j`` in increasing order (unrolled ``BU`` rows at a time, so that
    the loads of a block are in flight together). ``S`` rows have stride ``V``;
    ``M`` rows stride ``s_mk`` (unit columns). ``Mᵀ`` is read through the strides,
    never ``tl.trans`` (docs/machines.md)."""
    for j1 in range(0, BK, BU):
        for j0 in tl.static_range(0, BU, BJ):
            o_j = j1 + j0 + tl.arange(0, BJ)
            m_j = o_j < K
            if TRANSPOSE:  # Mᵀ[:, j] = M[j, :]
                p_a = p_m + o_j[None, :] * s_mk + o_k[:, None]
            else:  # M[:, j]
                p_a = p_m + o_k[:, None] * s_mk + o_j[None, :]
            p_b = p_s + o_j[:, None] * V + o_v[None, :]  # S[j, cols]
            if K == BK:  # no masks where none is needed: vector loads
                a = tl.load(p_a)
            else:
                a = tl.load(p_a, mask=m_k[:, None] & m_j[None, :], other=0.0)
            if K == BK and V % BV == 0:
                s = tl.load(p_b)
            else:
                s = tl.load(p_b, mask=m_j[:, None] & m_v[None, :], other=0.0)
            acc = tl.dot(a, s, acc, input_precision="ieee")
    return acc


@triton.jit
def _kcp_fold_kernel(
    M, S, E, O,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BJ: tl.constexpr,
    BU: tl.constexpr,
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
    off = i_h * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    if HAS_E:
        acc = tl.load(E + off, mask=m_kv, other=0.0)
    else:
        acc = tl.zeros([BK, BV], dtype=tl.float32)
    acc = _fold_tile(acc, M + i_h * K * K, K, S + i_h * K * V, o_k, m_k, o_v, m_v,
                     K, V, BK, BJ, BU, BV, TRANSPOSE)
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
    cfg = fold_config(K, V)
    _KCP_FOLD_KERNEL[(triton.cdiv(V, cfg["BV"]), HV)](
        M, S, E if E is not None else S, out,
        K=K, V=V, BK=cfg["BK"], BJ=cfg["BJ"], BU=cfg["BU"], BV=cfg["BV"], TRANSPOSE=transpose,
        HAS_E=E is not None, num_warps=cfg["num_warps"], num_stages=1, enable_fp_fusion=True,
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

    ``impl`` (default: :func:`resolve_fold_impl` — ``"triton"`` for fp32 CUDA
    tensors, else ``"torch"``) picks the arithmetic; the two agree to fp32
    rounding, not bitwise. On one device type the bits are those of every
    :func:`fold_chain` step with the same operands, whatever else that launch
    folds.
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
    BJ: tl.constexpr,
    BU: tl.constexpr,
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
        acc = tl.load(E + it * s_ep + i_h * s_eh + o_k[:, None] * s_ek + o_v[None, :],
                      mask=m_kv, other=0.0)
        if pv >= 0:  # this program's columns of the state: written by itself
            acc = _fold_tile(acc, M + it * s_mp + i_h * s_mh, s_mk,
                             O + (pv * HV + i_h) * K * V, o_k, m_k, o_v, m_v,
                             K, V, BK, BJ, BU, BV, TRANSPOSE)
        tl.store(O + (ds * HV + i_h) * K * V + off_s, acc, mask=m_kv)
        tl.debug_barrier()  # the next step reads this row back


_KCP_FOLD_CHAIN_KERNEL = cached_launch(_kcp_fold_chain_kernel)
_KCP_FOLD_KERNEL = cached_launch(_kcp_fold_kernel)


@launcher(uses_atomics=False, kernels=(_kcp_fold_chain_kernel,))
def _fold_chain_triton(E, M, out, items, prev, dst, ptr, transpose):
    P, HV, K, V = E.shape
    # the chain tables of a layout reach the device once (cached by value)
    d_items, d_prev, d_dst, d_ptr = device_int_tables((items, prev, dst, ptr), out.device)
    cfg = fold_config(K, V)
    n_chains = len(ptr) - 1
    _KCP_FOLD_CHAIN_KERNEL[(triton.cdiv(V, cfg["BV"]), HV, n_chains)](
        E, M, out, d_items, d_prev, d_dst, d_ptr,
        E.stride(0), E.stride(1), E.stride(2), M.stride(0), M.stride(1), M.stride(2),
        HV, K=K, V=V, BK=cfg["BK"], BJ=cfg["BJ"], BU=cfg["BU"], BV=cfg["BV"], TRANSPOSE=transpose,
        num_warps=cfg["num_warps"], num_stages=1, enable_fp_fusion=True,
    )


def _torch_levels(items, prev, dst, ptr) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The steps of the chains level by level (the ``level``-th step of every chain
    that long): per level ``(copy_items, copy_dst, fold_items, fold_prev, fold_dst)``."""
    lengths = [b - a for a, b in zip(ptr[:-1], ptr[1:])]
    levels = []
    for level in range(max(lengths, default=0)):
        steps = [a + level for a, n in zip(ptr[:-1], lengths) if n > level]
        copy = [s for s in steps if prev[s] < 0]
        fold = [s for s in steps if prev[s] >= 0]
        levels.append((tuple(items[s] for s in copy), tuple(dst[s] for s in copy),
                       tuple(items[s] for s in fold), tuple(prev[s] for s in fold),
                       tuple(dst[s] for s in fold)))
    return tuple(levels)


def _fold_chain_torch(E, M, out, items, prev, dst, ptr, transpose):
    P, HV, K, V = E.shape
    levels = _torch_levels(items, prev, dst, ptr)
    # the index tables reach the device once per chain layout (cached by value), not
    # as a host->device copy of Python lists per level and call
    flat = device_int_tables([t for lv in levels for t in lv], out.device, torch.int64)
    for i, (copy_items, _, fold_items, _, _) in enumerate(levels):
        c_src, c_dst, f_src, f_prev, f_dst = flat[5 * i: 5 * i + 5]
        if copy_items:
            out[c_dst] = E[c_src]
        if fold_items:
            n = len(fold_items)
            Ms = M[f_src].reshape(n * HV, K, K)
            Ss = out[f_prev].reshape(n * HV, K, V)
            Es = E[f_src].reshape(n * HV, K, V)
            res = _fold_torch(Ms, Ss, Es, transpose).reshape(n, HV, K, V)
            out[f_dst] = res


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
    the bits of :func:`fold_step` with the same ``impl`` (on CUDA: the same
    device type), whatever the number of chains, steps or segments in the call.
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
