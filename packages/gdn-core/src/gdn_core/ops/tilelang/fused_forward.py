"""The chunk recurrence and the chunk output in one hand-scheduled TileLang kernel.

**Status: experimental, used by no package path.** It is correct on the H200 (errors
against the fp32 reference at the Triton path's level, bitwise repeatable, non-finite
values contained per document) but slower than the Triton kernels it would replace
(``benchmarks/results/2026-12-01-h200-s8-fused-forward-tilelang.md``); it is kept as
the starting point of the fused forward (``docs/kernels.md``).

One CTA per (document, value head) walks the document's chunks of 64 tokens in
order. With ``S`` the ``[K, V]`` state entering a chunk, ``n`` the chunk's valid
rows, ``A = (I + A_gated)^{-1}`` its stored WY inverse
(:func:`~gdn_core.ops.wy.inverse_for_backward`), ``Γ = exp(G)``, ``γ = exp(G_last)``::

    X   = [t < n] · β ⊙ (V − Γ ⊙ (K S))          (= diag(β)(V − Γ K S))
    V'  = [t < n] · A X                           (= U − W S, "v_new")
    O   = scale · (Γ ⊙ (Q S) + P V'),   P_ij = [j ≤ i] (q_i·k_j) exp(G_i − G_j)
    S  ← γ S + K̃ᵀ V',   K̃ = [t < n] · K ⊙ exp(G_last − G)

so ``W`` and ``U`` never exist in memory. Four warpgroups share the work:

* **two chain warpgroups**, one per half of the value columns (``S[:, half]`` in
  fp32 registers): publish their half of ``S`` (rounded to the input type) in
  shared memory, ``K S``, ``X``, ``A X``, then the update ``γ S + K̃ᵀ V'`` — the
  serial work;
* **output** warpgroup: ``K̃`` into the stage's slot, ``Q S`` on the published
  state, ``P`` and ``P V'``, the store of ``o``;
* **producer** (one warp of the fourth warpgroup): TMA loads of each chunk's ``Q``,
  ``K``, ``V``, ``A`` tiles and coalesced loads of ``G``, ``β`` (transposed to
  ``[HV, T]`` rows by the launcher) into a two-stage ring.

Each hand-off goes through an mbarrier whose arrivals are ordered so that no
arriver can complete two phases before every waiter has waited on the first (the
comments at the arrivals say why). A document's last, partial chunk reads the next
document's rows through the TMA box; every use of them goes through a select
(never a multiplication by a mask), so a non-finite value in one document cannot
reach another, and a program's arithmetic depends only on its own document
(partition invariance). No atomics; fixed reduction order. Head dims ``K = V = 128``,
16-bit inputs.
"""

# No ``from __future__ import annotations``: TileLang reads the prim_func's
# annotations (tensor shapes over local symbols) as live objects.

import functools

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.registry import launcher

__all__ = ["fused_chunk_fwd_tl", "fused_forward_config", "supports"]

BT = 64
HALF = 64  # value columns of one chain warpgroup
_NREG = {"chain": 168, "out": 144, "producer": 32}


def supports(K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether this kernel serves head dims ``K, V`` at input ``dtype``."""
    return K == 128 and V == 128 and dtype in (torch.bfloat16, torch.float16)


def fused_forward_config(K: int, V: int) -> dict[str, int]:
    """Pinned launch configuration: ``stages`` of the input ring."""
    return {"stages": 2}


@functools.cache
def _kernel(K: int, V: int, NS: int, group: int, dtype: str, output: bool,
            store_h: bool, store_vnew: bool, use_h0: bool, store_final: bool):
    import tilelang
    import tilelang.language as T

    acc = "float32"
    Tt, N, H, HV = T.dynamic("T"), T.dynamic("N"), T.dynamic("H"), T.dynamic("HV")
    # unused outputs are passed as one-row dummies: each has its own leading extent
    NT, TO, TV, N0, NF = (T.dynamic(x) for x in ("NT", "TO", "TV", "N0", "NF"))
    TP = T.dynamic("TP")  # padded token extent of the transposed gate/beta rows

    @T.macro
    def chain(hh, S_s, X_s, VN_s, K_s, V_s, A_s, G_s, B_s, KD_s, full, empty, s_ready,
              vn_ready, s_free, o_done, kd_ready, h0, h, vnew, ht, n, hv, bos, eos, c0,
              n_chunks):
        # One column half of the recurrence: S[:, half] in fp32 registers.
        c_lo = hh * HALF
        S_f = T.alloc_fragment((K, HALF), acc)
        X_f = T.alloc_fragment((BT, HALF), acc)
        gl = T.alloc_local((1,), acc)
        if use_h0:
            T.copy(h0[n, hv, 0:K, c_lo:c_lo + HALF], S_f)
        else:
            T.clear(S_f)
        for ic in T.serial(n_chunks):
            s = ic % NS
            t0 = bos + ic * BT
            nv = T.min(eos - t0, BT)
            # S_s is free once the output warpgroup's Q S_{c-1} is done
            T.barrier_wait(s_free, (ic + 1) % 2)
            T.copy(S_f, S_s[hh, :, :])
            T.fence_proxy_async()
            T.barrier_arrive(s_ready)
            if store_h:
                T.copy(S_s[hh, :, :], h[c0 + ic, hv, 0:K, c_lo:c_lo + HALF])
            T.barrier_wait(full[s], (ic // NS) % 2)
            T.gemm(K_s[s, :, :], S_s[hh, :, :], X_f, clear_accum=True)
            for i, j in T.Parallel(BT, HALF):
                X_f[i, j] = T.if_then_else(
                    i < nv,
                    B_s[s, i] * (V_s[s, i, c_lo + j] - T.exp(G_s[s, i]) * X_f[i, j]),
                    0)
            T.copy(X_f, X_s[hh, :, :])
            T.fence_proxy_async()
            T.gemm(A_s[s, :, :], X_s[hh, :, :], X_f, clear_accum=True)
            # VN_s is free once the output warpgroup's P V'_{c-1} is done
            T.barrier_wait(o_done, (ic + 1) % 2)
            for i, j in T.Parallel(BT, HALF):
                VN_s[hh, i, j] = T.if_then_else(i < nv, X_f[i, j], 0)
            T.fence_proxy_async()
            T.barrier_arrive(vn_ready)
            gl[0] = T.exp(G_s[s, nv - 1])
            for i, j in T.Parallel(K, HALF):
                S_f[i, j] = S_f[i, j] * gl[0]
            T.barrier_wait(kd_ready, ic % 2)
            T.gemm(KD_s[s, :, :], VN_s[hh, :, :], S_f, transpose_A=True)
            T.barrier_arrive(empty[s])
            if store_vnew:
                for i, j in T.Parallel(BT, HALF):
                    if i < nv:
                        vnew[t0 + i, hv, c_lo + j] = VN_s[hh, i, j]
        if store_final:
            T.copy(S_f, ht[n, hv, 0:K, c_lo:c_lo + HALF])


    @T.prim_func
    def fused_forward(
        q: T.Tensor((Tt, H, K), dtype),
        k: T.Tensor((Tt, H, K), dtype),
        v: T.Tensor((Tt, HV, V), dtype),
        a: T.Tensor((Tt, HV, BT), dtype),
        Gt: T.Tensor((HV, TP), acc),
        bt: T.Tensor((HV, TP), acc),
        h0: T.Tensor((N0, HV, K, V), acc),
        offs: T.Tensor((N + 1,), "int32"),
        coffs: T.Tensor((N + 1,), "int32"),
        scale: T.float32,
        o: T.Tensor((TO, HV, V), dtype),
        h: T.Tensor((NT, HV, K, V), dtype),
        vnew: T.Tensor((TV, HV, V), dtype),
        ht: T.Tensor((NF, HV, K, V), acc),
    ):
        with T.Kernel(N, HV, threads=512) as (n, hv):
            hk = hv // group
            # the input ring (NS stages); K̃ rides with its stage
            Q_s = T.alloc_shared((NS, BT, K), dtype)
            K_s = T.alloc_shared((NS, BT, K), dtype)
            V_s = T.alloc_shared((NS, BT, V), dtype)
            A_s = T.alloc_shared((NS, BT, BT), dtype)
            G_s = T.alloc_shared((NS, BT), acc)
            B_s = T.alloc_shared((NS, BT), acc)
            KD_s = T.alloc_shared((NS, BT, K), dtype)
            # per column half: the published state, X and V'
            S_s = T.alloc_shared((2, K, HALF), dtype)
            X_s = T.alloc_shared((2, BT, HALF), dtype)
            VN_s = T.alloc_shared((2, BT, HALF), dtype)
            P_s = T.alloc_shared((BT, BT), dtype)
            ed_o = T.alloc_shared((BT,), acc)  # [i < n] exp(G_last − G_i)  (output wg)
            eg_o = T.alloc_shared((BT,), acc)  # scale · exp(G_i)          (output wg)

            full = T.alloc_barrier(arrive_count=[32] * NS)  # producer warp → consumers
            empty = T.alloc_barrier(arrive_count=[384] * NS)  # all consumers → producer
            s_ready = T.alloc_barrier(arrive_count=256)  # chain wgs: S_s holds S_c
            vn_ready = T.alloc_barrier(arrive_count=256)  # chain wgs: VN_s holds V'_c
            s_free = T.alloc_barrier(arrive_count=128)  # output wg: S_s read
            o_done = T.alloc_barrier(arrive_count=128)  # output wg: VN_s read
            kd_ready = T.alloc_barrier(arrive_count=128)  # output wg: KD_s[stage] written

            bos = offs[n]
            eos = offs[n + 1]
            c0 = coffs[n]
            n_chunks = T.ceildiv(eos - bos, BT)
            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(_NREG["chain"], 1)
                chain(0, S_s, X_s, VN_s, K_s, V_s, A_s, G_s, B_s, KD_s, full, empty,
                      s_ready, vn_ready, s_free, o_done, kd_ready, h0, h, vnew, ht, n, hv,
                      bos, eos, c0, n_chunks)
            elif tx < 256:
                T.set_max_nreg(_NREG["chain"], 1)
                chain(1, S_s, X_s, VN_s, K_s, V_s, A_s, G_s, B_s, KD_s, full, empty,
                      s_ready, vn_ready, s_free, o_done, kd_ready, h0, h, vnew, ht, n, hv,
                      bos, eos, c0, n_chunks)
            elif tx < 384:
                # ---------------- output warpgroup ----------------
                T.set_max_nreg(_NREG["out"], 1)
                P_f = T.alloc_fragment((BT, BT), acc)
                O_0 = T.alloc_fragment((BT, HALF), acc)
                O_1 = T.alloc_fragment((BT, HALF), acc)
                gl = T.alloc_local((1,), acc)
                for ic in T.serial(n_chunks):
                    s = ic % NS
                    t0 = bos + ic * BT
                    nv = T.min(eos - t0, BT)
                    T.barrier_wait(full[s], (ic // NS) % 2)
                    gl[0] = G_s[s, nv - 1]
                    for i in T.Parallel(BT):
                        eg_o[i] = T.exp(G_s[s, i]) * scale
                        ed_o[i] = T.exp(gl[0] - G_s[s, i])
                    for i, j in T.Parallel(BT, K):
                        KD_s[s, i, j] = T.if_then_else(i < nv, K_s[s, i, j] * ed_o[i], 0)
                    T.fence_proxy_async()
                    if output:
                        T.gemm(Q_s[s, :, :], K_s[s, :, :], P_f, transpose_B=True,
                               clear_accum=True)
                        for i, j in T.Parallel(BT, BT):
                            P_f[i, j] = T.if_then_else(
                                j <= i, P_f[i, j] * T.exp(G_s[s, i] - G_s[s, j]) * scale, 0)
                        T.copy(P_f, P_s)
                    T.barrier_wait(s_ready, ic % 2)
                    # after the s_ready wait: the chain warpgroups wait on kd_ready(c-1)
                    # before they can publish S_c, so no phase is skipped.
                    T.barrier_arrive(kd_ready)
                    if output:
                        T.gemm(Q_s[s, :, :], S_s[0, :, :], O_0, clear_accum=True)
                        T.gemm(Q_s[s, :, :], S_s[1, :, :], O_1, clear_accum=True)
                    T.barrier_arrive(s_free)
                    T.barrier_arrive(empty[s])  # the stage is not read here any more
                    T.barrier_wait(vn_ready, ic % 2)
                    if output:
                        for i, j in T.Parallel(BT, HALF):
                            O_0[i, j] = O_0[i, j] * eg_o[i]
                            O_1[i, j] = O_1[i, j] * eg_o[i]
                        T.gemm(P_s, VN_s[0, :, :], O_0)
                        T.gemm(P_s, VN_s[1, :, :], O_1)
                    T.barrier_arrive(o_done)
                    if output:
                        for i, j in T.Parallel(BT, HALF):
                            if i < nv:
                                o[t0 + i, hv, j] = O_0[i, j]
                                o[t0 + i, hv, HALF + j] = O_1[i, j]
            else:
                # ---------------- producer ----------------
                T.set_max_nreg(_NREG["producer"], 0)
                if tx < 416:
                    for ic in T.serial(n_chunks):
                        s = ic % NS
                        t0 = bos + ic * BT
                        T.barrier_wait(empty[s], (ic // NS + 1) % 2)
                        if output:
                            T.tma_copy(q[t0:t0 + BT, hk, 0:K], Q_s[s, :, :], barrier=full[s])
                        T.tma_copy(k[t0:t0 + BT, hk, 0:K], K_s[s, :, :], barrier=full[s])
                        T.tma_copy(v[t0:t0 + BT, hv, 0:V], V_s[s, :, :], barrier=full[s])
                        T.tma_copy(a[t0:t0 + BT, hv, 0:BT], A_s[s, :, :], barrier=full[s])
                        for i in T.Parallel(BT):
                            G_s[s, i] = Gt[hv, t0 + i]
                            B_s[s, i] = bt[hv, t0 + i]
                        T.barrier_arrive(full[s])

    return tilelang.compile(fused_forward, target={"kind": "cuda", "arch": "sm_90a"})


_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@launcher(uses_atomics=False)
def fused_chunk_fwd_tl(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    A_inv: torch.Tensor,
    G: torch.Tensor,
    beta: torch.Tensor,
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
        q: ``[T, H, K]`` or ``None`` (no output); k: ``[T, H, K]``; v: ``[T, HV, V]``;
            A_inv: ``[T, HV, 64]`` the WY inverse in the input dtype
            (:func:`~gdn_core.ops.wy.inverse_for_backward`); G: ``[T, HV]`` fp32 chunk-local
            cumsum of ``g``; beta: ``[T, HV]`` any float dtype. q, k, v, A_inv share one
            16-bit dtype.
        scale, index, group: as :func:`~gdn_core.ops.output.chunk_output_fwd`.
        initial_state: ``[N, HV, K, V]`` (read as fp32) or ``None``.
        output_final_state, store_states, store_v_new: which of ``final``,
            ``h``, ``v_new`` to return.

    Returns:
        ``(o, h, v_new, final)``: ``o [T, HV, V]``, ``h [NT, HV, K, V]`` (the state
        entering each chunk), ``v_new [T, HV, V]`` in the input dtype, ``final
        [N, HV, K, V]`` fp32; each ``None`` when not asked for.

    Raises:
        ValueError: shapes or dtypes this kernel does not serve (:func:`supports`).
    """
    T_, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    N, NT = index.num_docs, index.num_chunks
    dt = k.dtype
    if not supports(K, V, dt) or any(x.dtype != dt for x in (v, A_inv)) or (
            q is not None and q.dtype != dt):
        raise ValueError(f"the fused TileLang forward serves K = V = 128 in one 16-bit dtype, "
                         f"got K={K}, V={V}, dtypes k {dt}, v {v.dtype}, A_inv {A_inv.dtype}")
    if (tuple(A_inv.shape) != (T_, HV, BT) or v.shape[0] != T_ or HV != H * group
            or tuple(G.shape) != (T_, HV) or tuple(beta.shape) != (T_, HV)
            or T_ != index.total_tokens or index.chunk_size != BT):
        raise ValueError(f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, A_inv "
                         f"{tuple(A_inv.shape)}, G {tuple(G.shape)}, beta {tuple(beta.shape)}, "
                         f"group {group}, chunk size {index.chunk_size}")
    dev = k.device
    out: list[torch.Tensor | None] = [None, None, None, None]
    if q is not None:
        out[0] = torch.empty(T_, HV, V, dtype=dt, device=dev)
    if store_states:
        out[1] = torch.empty(NT, HV, K, V, dtype=dt, device=dev)
    if store_v_new:
        out[2] = torch.empty(T_, HV, V, dtype=dt, device=dev)
    if output_final_state:
        out[3] = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if N == 0 or HV == 0 or T_ == 0:
        if out[3] is not None:
            if initial_state is not None:
                out[3].copy_(initial_state)
            else:
                out[3].zero_()
        return out[0], out[1], out[2], out[3]
    cfg = fused_forward_config(K, V)
    kern = _kernel(K, V, cfg["stages"], group, _DTYPES[dt], q is not None,
                   store_states, store_v_new, initial_state is not None, output_final_state)
    # the gate cumsum and beta as fp32 rows per value head (a TMA box each), padded to
    # whole chunks (16-byte row strides)
    TP = -(-T_ // BT) * BT + BT
    Gt = torch.zeros(HV, TP, dtype=torch.float32, device=dev)
    bt = torch.zeros(HV, TP, dtype=torch.float32, device=dev)
    Gt[:, :T_].copy_(G.t())
    bt[:, :T_].copy_(beta.t())

    def dummy(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((1, *shape[1:]), dtype=dtype, device=dev)

    h0 = (initial_state.float().contiguous() if initial_state is not None
          else dummy((1, HV, K, V), torch.float32))
    kern(
        (q if q is not None else k).contiguous(), k.contiguous(), v.contiguous(),
        A_inv.contiguous(), Gt, bt, h0,
        index.doc_offsets, index.doc_chunk_offsets, float(scale),
        out[0] if out[0] is not None else dummy((1, HV, V), dt),
        out[1] if out[1] is not None else dummy((1, HV, K, V), dt),
        out[2] if out[2] is not None else dummy((1, HV, V), dt),
        out[3] if out[3] is not None else dummy((1, HV, K, V), torch.float32),
    )
    return out[0], out[1], out[2], out[3]
