"""Stage 3: the chunk-state recurrence.

Per document, value head and block of value columns, walking the document's
chunks in order with the state ``S`` (``[K, BV]``) in fp32 registers::

    h_c    = S                                         (stored, input dtype)
    V'     = U − W S                                   ("v_new")
    S     ← exp(G_last) S + (K ⊙ exp(G_last − G))ᵀ V'

``Kᵀ`` is loaded through transposed pointer strides (no ``tl.trans``). The
value width comes from ``U`` (not from ``v``): with ``U = 0 [T, HV, K]`` and
``initial_state = I`` the kernel computes the chunk transition matrix ``M``
used by context parallelism. One program per (value block, document, value
head); no atomics.

Segment summaries (:mod:`gdn_core.segment`): with ``state_width = V + K`` and
``identity_state=True`` the state is ``[E | M]`` — columns ``[0, V)`` start
at zero and take ``U``, columns ``[V, V + K)`` start at the identity and take
a zero ``U`` (never materialised) — so one launch returns every "document"'s
``(S_ext, M)``; ``need`` (one int per document: bit 0 the ``E`` columns, bit 1
the ``M`` columns) lets programs whose columns nobody reads return at once.
Every column block is its own program, so a block's bits do not depend on
which other blocks or documents the launch holds.

In :func:`chunk_state_outputs_fwd` (``STORE_OUT``) each chunk also writes its outputs from the
state it enters with, ``scale ((Q ⊙ e^G) S + (Q Kᵀ ⊙ D) V')`` (``D`` the causal
decay), in fp32. For the ``E`` columns of a summary these are the segment's outputs
from a zero entry state, ``o⁰``. For its ``M`` columns they are the entry state's
queries ``q̃`` (:func:`gdn_core.reference.entry_state_queries_ref`), so that
``o = o⁰ + q̃ S_in`` once the fold gives ``S_in`` (``docs/exact_split.md``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn_core.chunking import ChunkIndex, ordered_docs
from gdn_core.ops.doc_walk import doc_grid, doc_program
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher
from gdn_core.ops.tiles import dot_tile

__all__ = ["chunk_state_config", "chunk_state_fwd", "chunk_state_outputs_fwd"]


@triton.jit
def _chunk_state_fwd_kernel(
    k,
    W,
    U,
    G,
    h0,
    h,
    v_new,
    ht,
    doc_offsets,
    doc_chunk_offsets,
    need,
    doc_order,
    q,
    out,
    scale,
    H,
    HV,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    VU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    H0_EYE: tl.constexpr,
    HAS_NEED: tl.constexpr,
    STORE_H: tl.constexpr,
    STORE_VNEW: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    PREC: tl.constexpr,
    ORDERED: tl.constexpr = False,
    STORE_OUT: tl.constexpr = False,
):
    # V: the state's width; VU: the columns that take U (the rest take zero).
    i_v = tl.program_id(0)
    i_n, i_hv = doc_program(doc_order, ORDERED)
    i_h = i_hv // GROUP
    if HAS_NEED:
        flags = tl.load(need + i_n)
        want_u = ((flags & 1) != 0) & (i_v * BV < VU)
        want_z = ((flags & 2) != 0) & (i_v * BV + BV > VU)
        if not (want_u | want_z):
            return
    bos = tl.load(doc_offsets + i_n).to(tl.int64)
    eos = tl.load(doc_offsets + i_n + 1).to(tl.int64)
    c0 = tl.load(doc_chunk_offsets + i_n).to(tl.int64)

    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mu = rv < VU
    m_kv = mk[:, None] & mv[None, :]
    s_off = rk[:, None] * V + rv[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0)
    if H0_EYE:
        S += tl.where(rk[:, None] == rv[None, :] - VU, 1.0, 0.0)

    KS = H * K
    n_chunks = tl.cdiv(eos - bos, BT)
    for ic in range(0, n_chunks):
        t0 = bos + ic * BT
        n = tl.minimum(eos - t0, BT).to(tl.int32)
        mt = rt < n
        if STORE_H:
            p_h = h + ((c0 + ic) * HV + i_hv) * K * V
            tl.store(p_h + s_off, S.to(h.dtype.element_ty), mask=m_kv)
        b_w = tl.load(
            W + (t0 + rt[:, None]) * HV * K + i_hv * K + rk[None, :],
            mask=mt[:, None] & mk[None, :],
            other=0.0,
        )
        b_u = tl.load(
            U + (t0 + rt[:, None]) * HV * VU + i_hv * VU + rv[None, :],
            mask=mt[:, None] & mu[None, :],
            other=0.0,
        ).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, S.to(b_w.dtype), input_precision=PREC)
        if STORE_VNEW:
            tl.store(
                v_new + (t0 + rt[:, None]) * HV * V + i_hv * V + rv[None, :],
                b_vn.to(v_new.dtype.element_ty),
                mask=mt[:, None] & mv[None, :],
            )
        p_g = G + t0 * HV + i_hv
        g_last = tl.load(p_g + (n - 1) * HV)
        b_g = tl.load(p_g + rt * HV, mask=mt, other=0.0)
        dec = tl.where(mt, tl.exp(tl.where(mt, g_last - b_g, 0.0)), 0.0)
        b_kt = tl.load(
            k + (t0 + rt[None, :]) * KS + i_h * K + rk[:, None],
            mask=mk[:, None] & mt[None, :],
            other=0.0,
        )
        if STORE_OUT:  # the chunk's outputs from S: scale ((Q ⊙ e^G) S + (Q Kᵀ ⊙ D) V')
            b_q = tl.load(
                q + (t0 + rt[:, None]) * KS + i_h * K + rk[None, :],
                mask=mt[:, None] & mk[None, :],
                other=0.0,
            )
            causal = (rt[:, None] >= rt[None, :]) & mt[:, None] & mt[None, :]
            d_ts = tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0))
            b_a = tl.where(causal, tl.dot(b_q, b_kt, input_precision=PREC) * d_ts, 0.0)
            b_qg = (b_q * tl.exp(b_g)[:, None]).to(b_q.dtype)
            b_o = tl.dot(b_qg, S.to(b_q.dtype), input_precision=PREC)
            b_o = tl.dot(b_a.to(b_q.dtype), b_vn.to(b_q.dtype), b_o, input_precision=PREC)
            tl.store(
                out + (t0 + rt[:, None]) * HV * V + i_hv * V + rv[None, :],
                b_o * scale,
                mask=mt[:, None] & mv[None, :],
            )
        b_vd = (b_vn * dec[:, None]).to(b_kt.dtype)
        S = S * tl.exp(g_last)
        S = tl.dot(b_kt, b_vd, S, input_precision=PREC)

    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, S, mask=m_kv)


_CHUNK_STATE_FWD_KERNEL = cached_launch(_chunk_state_fwd_kernel)


def chunk_state_config(K: int, V: int, elem_bytes: int = 2, programs: int = 0) -> dict[str, int]:
    """Pinned launch configuration of the state kernel for head dims ``K, V``.

    ``BK`` covers all of ``K`` (the state's rows live in one tile); ``BV``
    trades parallelism (programs = docs × HV × V/BV) against per-program work.
    The chunk loop is a serial chain (dot → v_new → dot), so the next chunks'
    tiles must already be in flight: with ``num_stages=3`` the pipeliner issues
    chunk ``c+2``'s ``W``, ``U``, ``K`` and ``G`` copies while chunk ``c`` runs
    (with 2 they are issued after chunk ``c``'s dots and waited on at once).
    Three stages fit in shared memory for 16-bit inputs (``elem_bytes=2``) up
    to ``BK = 128``; fp32 inputs and ``BK = 256`` keep two.

    ``programs`` (documents × value heads of the launch): from 128 on, 16-bit
    inputs at ``BK = 128`` take ``BV = 64`` on 4 warps — on the H200 0.421 against
    0.457 ms at B1 T32768 H16 with 8 documents, where one document (16 programs)
    runs 0.66× as fast (``benchmarks/results/2026-12-01-h200-s7-fused-forward-probes.md``,
    ``…-s5-kernel-variants.txt``). Value columns are independent, so the bits
    are the same at either width: a document's result does not depend on how
    many others share its launch (partition invariance).
    """
    BK = dot_tile(K, 256)
    if BK == 128 and elem_bytes <= 2 and V <= 128 and programs >= 128:
        return {"BK": BK, "BV": dot_tile(V, 64), "num_warps": 4, "num_stages": 3}
    BV = dot_tile(V, 32 if BK >= 128 else 64)
    num_warps = 4 if BK * BV <= 64 * 64 else 8
    stages = 3 if BK <= 128 and elem_bytes <= 2 else 2
    return {"BK": BK, "BV": BV, "num_warps": num_warps, "num_stages": stages}


@launcher(uses_atomics=False, kernels=(_chunk_state_fwd_kernel,))
def chunk_state_fwd(
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    index: ChunkIndex,
    group: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    store_states: bool = True,
    *,
    state_width: int | None = None,
    identity_state: bool = False,
    store_v_new: bool = True,
    need: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run the chunk-state recurrence over every document.

    Args:
        k: ``[T, H, K]`` keys (the ones used by :func:`wy_fwd`), head
            ``hv // group`` serves value head ``hv``.
        W: ``[T, HV, K]`` from :func:`wy_fwd` (same dtype as ``k``).
        U: ``[T, HV, VU]`` from :func:`wy_fwd` (any multiple of 16 up to 256).
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g``.
        index: the chunk table.
        group: value heads per key head.
        initial_state: ``[N, HV, K, V]`` (read as fp32) or ``None`` (zeros).
        output_final_state: return the state after each document.
        store_states: store the state entering each chunk.
        state_width: the state's width ``V`` (default ``VU``); columns
            ``[VU, V)`` take a zero ``U``. Only with ``store_states=False``
            and ``store_v_new=False``.
        identity_state: start from ``[0 | I]`` (the identity in columns
            ``[VU, VU + K)``; needs ``V == VU + K`` and no ``initial_state``).
        store_v_new: store ``v_new`` (else ``None`` is returned for it).
        need: optional int32 ``[N]`` on the device: bit 0 — document ``n``'s
            columns ``[0, VU)`` are wanted, bit 1 — its columns ``[VU, V)``;
            programs of unwanted columns return at once (their outputs are
            left unwritten).

    Returns:
        ``(h, v_new, final)``: ``h: [NT, HV, K, V]`` in ``k``'s dtype (or
        ``None`` if not ``store_states``), ``v_new: [T, HV, V]`` in ``U``'s
        dtype (or ``None``), ``final: [N, HV, K, V]`` fp32 (or ``None``). A
        zero-length document's final state is its initial state (or zeros).
    """
    return _walk(k, W, U, G, index, group, initial_state=initial_state,
                 output_final_state=output_final_state, store_states=store_states,
                 state_width=state_width, identity_state=identity_state,
                 store_v_new=store_v_new, need=need, q=None, out=None, scale=1.0)


@launcher(uses_atomics=False, kernels=(_chunk_state_fwd_kernel,))
def chunk_state_outputs_fwd(
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    index: ChunkIndex,
    group: int,
    q: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    state_width: int | None = None,
    identity_state: bool = False,
    need: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The state walk of :func:`chunk_state_fwd` (neither ``h`` nor ``v_new`` stored) that
    also writes each chunk's outputs from the state it enters with (module docstring):
    ``out[t] = scale ((Q ⊙ e^G) S + (Q Kᵀ ⊙ D) V')``, ``D`` the causal decay. These are the
    outputs ``o`` in the ``U`` columns, and the entry-state queries ``q̃`` in the identity's
    columns of a summary. Programs that ``need`` skips leave their rows and columns
    unwritten.

    Args:
        q: ``[T, H, K]`` queries in ``k``'s dtype.
        out: ``[T, HV, V]`` contiguous fp32 (``V``: the state's width).
        scale: the outputs' scale.
        k, W, U, G, index, group, initial_state, output_final_state, state_width,
            identity_state, need: as :func:`chunk_state_fwd`.

    Returns:
        The final states ``[N, HV, K, V]`` fp32 (or ``None``).

    Raises:
        ValueError: as :func:`chunk_state_fwd`, and for a ``q`` or ``out`` of another
            shape or dtype.
    """
    return _walk(k, W, U, G, index, group, initial_state=initial_state,
                 output_final_state=output_final_state, store_states=False,
                 state_width=state_width, identity_state=identity_state, store_v_new=False,
                 need=need, q=q, out=out, scale=scale)[2]


def _walk(k: torch.Tensor, W: torch.Tensor, U: torch.Tensor, G: torch.Tensor,
          index: ChunkIndex, group: int, *, initial_state: torch.Tensor | None,
          output_final_state: bool, store_states: bool, state_width: int | None,
          identity_state: bool, store_v_new: bool, need: torch.Tensor | None,
          q: torch.Tensor | None, out: torch.Tensor | None, scale: float
          ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Both launchers' checks and launch (arguments as theirs; ``q``, ``out`` ``None``:
    no outputs)."""
    T, H, K = k.shape
    HV, VU = U.shape[1], U.shape[2]
    V = VU if state_width is None else int(state_width)
    N, NT = index.num_docs, index.num_chunks
    if (
        tuple(W.shape) != (T, HV, K)
        or U.shape[0] != T
        or HV != H * group
        or tuple(G.shape) != (T, HV)
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, W {tuple(W.shape)}, U {tuple(U.shape)}, "
            f"G {tuple(G.shape)}, group {group}, index tokens {index.total_tokens}"
        )
    for name, d in (("K", K), ("V", VU)):
        if d % 16 != 0 or not 16 <= d <= 256:
            raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")
    if V != VU:
        if V < VU or V > 512 or V % 16:
            raise ValueError(f"state_width must be a multiple of 16 in [{VU}, 512], got {V}")
        if store_states or store_v_new:
            raise ValueError("state_width != U's width only computes final states: pass "
                             "store_states=False and store_v_new=False")
    if identity_state:
        if V != VU + K or initial_state is not None:
            raise ValueError("identity_state needs state_width == U's width + K and no "
                             "initial_state")
    if need is not None and (need.dtype != torch.int32 or tuple(need.shape) != (N,)):
        raise ValueError(f"need must be int32 [N={N}], got {need.dtype} {tuple(need.shape)}")
    if q is not None:
        if tuple(q.shape) != (T, H, K) or q.dtype != k.dtype:
            raise ValueError(f"q must be [T, H, K] = {(T, H, K)} in k's dtype {k.dtype}, "
                             f"got {q.dtype} {tuple(q.shape)}")
        if (tuple(out.shape) != (T, HV, V) or out.dtype != torch.float32
                or not out.is_contiguous()):
            raise ValueError(f"out must be contiguous fp32 [T, HV, V] = {(T, HV, V)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        q = q.contiguous()
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, "
                f"got {tuple(initial_state.shape)}"
            )
        initial_state = initial_state.to(torch.float32).contiguous()
    k, W, U, G = (x.contiguous() for x in (k, W, U, G))
    if G.dtype != torch.float32:
        G = G.float()
    dev = k.device
    h = torch.empty(NT, HV, K, V, dtype=k.dtype, device=dev) if store_states else None
    v_new = torch.empty(T, HV, V, dtype=U.dtype, device=dev) if store_v_new else None
    final = None
    if output_final_state:
        final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if N == 0 or HV == 0:
        return h, v_new, final
    if T == 0:
        # every document is empty: nothing to walk, the state passes through.
        if final is not None:
            if initial_state is not None:
                final.copy_(initial_state)
            else:
                final.zero_()
                if identity_state:
                    final[..., VU:].copy_(torch.eye(K, dtype=torch.float32, device=dev))
        return h, v_new, final
    cfg = chunk_state_config(K, V, k.element_size(), programs=N * HV)
    order = ordered_docs(index)
    grid = doc_grid(triton.cdiv(V, cfg["BV"]), N, HV, order)
    _CHUNK_STATE_FWD_KERNEL[grid](
        k, W, U, G, initial_state, h, v_new, final, index.doc_offsets, index.doc_chunk_offsets,
        need, order, q, out, float(scale), H, HV, ORDERED=order is not None, GROUP=group,
        K=K, V=V, VU=VU, STORE_OUT=q is not None,
        BT=index.chunk_size, BK=cfg["BK"], BV=cfg["BV"], USE_H0=initial_state is not None,
        H0_EYE=identity_state, HAS_NEED=need is not None, STORE_H=store_states,
        STORE_VNEW=store_v_new, STORE_FINAL=output_final_state,
        PREC="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return h, v_new, final
