"""The chunk-state recurrence, and optionally the output, as one warp-specialised TileLang kernel.

Per document, value head and block of ``BV`` value columns, walking the
document's chunks in order with the state ``S`` (``[K, BV]``, fp32 registers)::

    h_c = S                                                     (optional store)
    V'  = U − W S                                               (optional store)
    O   = scale · ( diag(exp G) Q S + (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j]) V' )   (optional)
    S  ← exp(G_last) S + (K ⊙ exp(G_last − G))ᵀ V'

the same arithmetic and roundings as the Triton pair
:func:`~gdn_core.ops.chunk_state.chunk_state_fwd` →
:func:`~gdn_core.ops.output.chunk_output_fwd` (``S`` and ``V'`` enter the dots
rounded to the input type). TileLang turns the chunk loop into a TMA producer
warpgroup that keeps the next chunk's ``W``, ``K``, ``U``, ``Q`` tiles in
flight and a consumer warpgroup on wgmma — what Triton 3.6 does not do on
Hopper (its loop warp specialisation is Blackwell-only), and why this kernel
exists. The rows of a document's last, partial chunk that belong to the next
document are read (a TMA box is whole) but never used: every use goes through
a select, and those ``K`` rows are zeroed, so a non-finite value in one
document cannot reach another. No atomics; a program's arithmetic depends only
on its own document (partition invariance). Head dims ``K = V = 128``, 16-bit
inputs.
"""

# No ``from __future__ import annotations``: TileLang reads the prim_func's
# annotations (tensor shapes over local symbols) as live objects.

import functools

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.registry import launcher

__all__ = ["chunk_state_output_fwd_tl", "supports"]

BT = 64


def supports(K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether this kernel serves head dims ``K, V`` at input ``dtype``."""
    return K == 128 and V == 128 and dtype in (torch.bfloat16, torch.float16)


@functools.cache
def _kernel(K: int, V: int, BV: int, group: int, dtype: str, output: bool, store_h: bool,
            store_vnew: bool, use_h0: bool, store_final: bool, threads: int, stages: int):
    import tilelang
    import tilelang.language as T

    acc = "float32"
    Tt, N, H, HV = T.dynamic("T"), T.dynamic("N"), T.dynamic("H"), T.dynamic("HV")
    # unused outputs are passed as one-row dummies: each has its own leading extent
    NT, TO, TV, N0, NF = (T.dynamic(x) for x in ("NT", "TO", "TV", "N0", "NF"))

    @T.prim_func
    def state_output(
        q: T.Tensor((Tt, H, K), dtype),
        k: T.Tensor((Tt, H, K), dtype),
        W: T.Tensor((Tt, HV, K), dtype),
        U: T.Tensor((Tt, HV, V), dtype),
        G: T.Tensor((Tt, HV), acc),
        h0: T.Tensor((N0, HV, K, V), acc),
        offs: T.Tensor((N + 1,), "int32"),
        coffs: T.Tensor((N,), "int32"),
        scale: T.float32,
        o: T.Tensor((TO, HV, V), dtype),
        h: T.Tensor((NT, HV, K, V), dtype),
        vnew: T.Tensor((TV, HV, V), dtype),
        ht: T.Tensor((NF, HV, K, V), acc),
    ):
        with T.Kernel(V // BV, N, HV, threads=threads) as (iv, n, hv):
            S_f = T.alloc_fragment((K, BV), acc)
            S_s = T.alloc_shared((K, BV), dtype)
            W_s = T.alloc_shared((BT, K), dtype)
            K_s = T.alloc_shared((BT, K), dtype)
            U_s = T.alloc_shared((BT, BV), dtype)
            VN_f = T.alloc_fragment((BT, BV), acc)
            VN_s = T.alloc_shared((BT, BV), dtype)
            VD_s = T.alloc_shared((BT, BV), dtype)
            g_s = T.alloc_shared((BT,), acc)
            if output:
                Q_s = T.alloc_shared((BT, K), dtype)
                O_f = T.alloc_fragment((BT, BV), acc)
                A_f = T.alloc_fragment((BT, BT), acc)
                A_s = T.alloc_shared((BT, BT), dtype)
            bos = offs[n]
            eos = offs[n + 1]
            c0 = coffs[n]
            if use_h0:
                T.copy(h0[n, hv, 0:K, iv * BV:(iv + 1) * BV], S_f)
            else:
                T.clear(S_f)
            for ic in T.Pipelined(T.ceildiv(eos - bos, BT), num_stages=stages):
                t0 = bos + ic * BT
                T.copy(W[t0:t0 + BT, hv, 0:K], W_s)
                T.copy(k[t0:t0 + BT, hv // group, 0:K], K_s)
                T.copy(U[t0:t0 + BT, hv, iv * BV:(iv + 1) * BV], U_s)
                if output:
                    T.copy(q[t0:t0 + BT, hv // group, 0:K], Q_s)
                for i in T.Parallel(BT):
                    g_s[i] = G[t0 + i, hv]
                if t0 + BT > eos:  # rows past the document's end: zero the keys
                    for i, j in T.Parallel(BT, K):
                        if t0 + i >= eos:
                            K_s[i, j] = 0
                g_last = G[T.min(t0 + BT, eos) - 1, hv]
                T.copy(S_f, S_s)
                if store_h:
                    T.copy(S_s, h[c0 + ic, hv, 0:K, iv * BV:(iv + 1) * BV])
                T.gemm(W_s, S_s, VN_f, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    VN_f[i, j] = T.if_then_else(t0 + i < eos, U_s[i, j] - VN_f[i, j], 0)
                T.copy(VN_f, VN_s)
                if store_vnew:
                    for i, j in T.Parallel(BT, BV):
                        if t0 + i < eos:
                            vnew[t0 + i, hv, iv * BV + j] = VN_s[i, j]
                if output:
                    T.gemm(Q_s, S_s, O_f, clear_accum=True)
                    T.gemm(Q_s, K_s, A_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(BT, BT):
                        A_f[i, j] = T.if_then_else((i >= j) & (t0 + i < eos),
                                                   A_f[i, j] * T.exp(g_s[i] - g_s[j]), 0)
                    T.copy(A_f, A_s)
                    for i, j in T.Parallel(BT, BV):
                        O_f[i, j] = O_f[i, j] * T.exp(g_s[i])
                    T.gemm(A_s, VN_s, O_f)
                    for i, j in T.Parallel(BT, BV):
                        if t0 + i < eos:
                            o[t0 + i, hv, iv * BV + j] = O_f[i, j] * scale
                for i, j in T.Parallel(BT, BV):
                    VD_s[i, j] = T.if_then_else(t0 + i < eos,
                                                VN_f[i, j] * T.exp(g_last - g_s[i]), 0)
                for i, j in T.Parallel(K, BV):
                    S_f[i, j] = S_f[i, j] * T.exp(g_last)
                T.gemm(K_s, VD_s, S_f, transpose_A=True)
            if store_final:
                T.copy(S_f, ht[n, hv, 0:K, iv * BV:(iv + 1) * BV])

    return tilelang.compile(state_output, target={"kind": "cuda", "arch": "sm_90a"})


def state_output_tl_config(K: int, V: int) -> dict[str, int]:
    """Pinned launch configuration: ``BV`` columns a program, consumer ``threads``
    (TileLang adds a producer warpgroup of its own), pipeline ``stages``."""
    return {"BV": 64, "threads": 128, "stages": 2}


@launcher(uses_atomics=False)
def chunk_state_output_fwd_tl(
    q: torch.Tensor | None,
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    store_states: bool = False,
    store_v_new: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The recurrence over every document; with ``q``, the chunk outputs too.

    Args:
        q: ``[T, H, K]`` or ``None`` (no output); k: ``[T, H, K]``; W: ``[T, HV, K]``;
            U: ``[T, HV, V]`` (16-bit, one dtype); G: ``[T, HV]`` fp32.
        scale, index, group: as :func:`~gdn_core.ops.output.chunk_output_fwd`.
        initial_state: ``[N, HV, K, V]`` (read as fp32) or ``None``.
        output_final_state, store_states, store_v_new: which of ``final``,
            ``h``, ``v_new`` to return.

    Returns:
        ``(o, h, v_new, final)``: ``o [T, HV, V]``, ``h [NT, HV, K, V]``,
        ``v_new [T, HV, V]`` in the input dtype, ``final [N, HV, K, V]`` fp32;
        each ``None`` when not asked for.

    Raises:
        ValueError: shapes or dtypes this kernel does not serve (:func:`supports`).
    """
    T_, H, K = k.shape
    HV, V = U.shape[1], U.shape[2]
    N, NT = index.num_docs, index.num_chunks
    if not supports(K, V, k.dtype) or not all(x.dtype == k.dtype for x in (W, U)) or (
        q is not None and q.dtype != k.dtype):
        raise ValueError(f"the TileLang state kernel serves K = V = 128 in one 16-bit dtype, "
                         f"got K={K}, V={V}, dtypes k {k.dtype}, W {W.dtype}, U {U.dtype}")
    if tuple(W.shape) != (T_, HV, K) or U.shape[0] != T_ or HV != H * group or (
            tuple(G.shape) != (T_, HV)) or T_ != index.total_tokens:
        raise ValueError(f"shape mismatch: k {tuple(k.shape)}, W {tuple(W.shape)}, "
                         f"U {tuple(U.shape)}, G {tuple(G.shape)}, group {group}")
    dev, dt = k.device, k.dtype
    out = [None, None, None, None]
    if q is not None:
        out[0] = torch.empty(T_, HV, V, dtype=dt, device=dev)
    if store_states:
        out[1] = torch.empty(NT, HV, K, V, dtype=dt, device=dev)
    if store_v_new:
        out[2] = torch.empty(T_, HV, V, dtype=dt, device=dev)
    if output_final_state:
        out[3] = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if N == 0 or HV == 0 or T_ == 0:
        if out[3] is not None and initial_state is not None:
            out[3].copy_(initial_state)
        elif out[3] is not None:
            out[3].zero_()
        return tuple(out)
    cfg = state_output_tl_config(K, V)
    dtype_name = "bfloat16" if dt == torch.bfloat16 else "float16"
    kern = _kernel(K, V, cfg["BV"], group, dtype_name, q is not None, store_states, store_v_new,
                   initial_state is not None, output_final_state, cfg["threads"], cfg["stages"])

    def dummy(shape, dtype):
        return torch.empty((1, *shape[1:]), dtype=dtype, device=dev)

    h0 = (initial_state.float().contiguous() if initial_state is not None
          else dummy((1, HV, K, V), torch.float32))
    kern(
        (q if q is not None else k).contiguous(), k.contiguous(), W.contiguous(), U.contiguous(),
        G.float().contiguous(), h0, index.doc_offsets, index.doc_chunk_offsets, float(scale),
        out[0] if out[0] is not None else dummy((1, HV, V), dt),
        out[1] if out[1] is not None else dummy((1, HV, K, V), dt),
        out[2] if out[2] is not None else dummy((1, HV, V), dt),
        out[3] if out[3] is not None else dummy((1, HV, K, V), torch.float32),
    )
    return tuple(out)
