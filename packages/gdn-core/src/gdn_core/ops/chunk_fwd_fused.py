"""The forward's last phase in one kernel: the chunk-state recurrence and the chunk output.

:func:`~gdn_core.ops.chunk_state.chunk_state_fwd` followed by
:func:`~gdn_core.ops.output.chunk_output_fwd` without the states ``h`` and ``v_new``
between them ever reaching memory. One program per (value block, document, value
head) walks the document's chunks in order with ``S`` (``[K, BV]``) in fp32
registers; per chunk::

    h_c = S                              (rounded as chunk_state_fwd stores it)
    V'  = U − W h_c                      (rounded as it stores v_new, for the output)
    O   = scale · ( diag(exp G) Q h_c + (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j]) V' )
    S  ← exp(G_last) S + (K ⊙ exp(G_last − G))ᵀ V'

Every operation, rounding and operand of the two kernels is repeated in their order
(``S`` rounded to the input dtype for ``W h_c`` and ``Q h_c``, ``V'`` rounded to
``U``'s dtype for the output's dot, fp32 ``V'`` for the update). The one change:
``Q h_c`` and ``Q Kᵀ`` are single dots over all of ``K`` (the state lives in one
``[K, BV]`` tile), where the output kernel accumulates blocks of 64 rows of ``K``
(``acc = dot(q₀, h₀); acc = dot(q₁, h₁, acc)``). On sm_90 both are the same
sequence of k16 ``wgmma`` steps into one fp32 accumulator (and the same FMA chain
for fp32 inputs), so the bits are the two-kernel path's (``tests/
test_chunk_fwd_fused_gpu.py`` checks it on the H200); under the interpreter a
chained dot is ``matmul + acc`` (one more rounding), so for ``K > 64`` the output's
bits differ there (within fp32 rounding; the single dot has one rounding fewer) while
the final state's do not. For ``K ≤ 64`` (one block) both paths are the same
operations anywhere. Value columns are independent,
so the bits do not depend on ``BV`` or on which documents share a launch. No atomics.
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

__all__ = ["check_fused_fwd_shapes", "chunk_fwd_fused", "chunk_fwd_fused_config"]


@triton.jit
def _chunk_fwd_fused_kernel(
    q,
    k,
    W,
    U,
    G,
    h0,
    o,
    ht,
    doc_offsets,
    doc_order,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    PREC: tl.constexpr,
    ORDERED: tl.constexpr = False,
):
    # H, HV are constexpr (unlike the two kernels'): compile-time row strides let the
    # address tiles fold into immediates — at bf16 K = V = 128 that is the difference
    # between ~170 bytes of spills and none.
    i_v = tl.program_id(0)
    i_n, i_hv = doc_program(doc_order, ORDERED)
    i_h = i_hv // GROUP
    bos = tl.load(doc_offsets + i_n).to(tl.int64)
    eos = tl.load(doc_offsets + i_n + 1).to(tl.int64)

    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    m_kv = mk[:, None] & mv[None, :]
    s_off = rk[:, None] * V + rv[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0)

    KS = H * K
    n_chunks = tl.cdiv(eos - bos, BT)
    for ic in range(0, n_chunks):
        t0 = bos + ic * BT
        n = tl.minimum(eos - t0, BT).to(tl.int32)
        mt = rt < n
        m_tv = mt[:, None] & mv[None, :]
        # ---- chunk_state_fwd's step: V' = U − W h_c, then the update of S. h_c and V'
        # are kept as the two-kernel path stores them (the input dtype, U's dtype) for
        # the output below, which runs after the update (fewer live registers).
        b_w = tl.load(
            W + (t0 + rt[:, None]) * HV * K + i_hv * K + rk[None, :],
            mask=mt[:, None] & mk[None, :],
            other=0.0,
        )
        b_u = tl.load(
            U + (t0 + rt[:, None]) * HV * V + i_hv * V + rv[None, :],
            mask=m_tv,
            other=0.0,
        ).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, S.to(b_w.dtype), input_precision=PREC)
        p_g = G + t0 * HV + i_hv
        g_last = tl.load(p_g + (n - 1) * HV)
        b_g = tl.load(p_g + rt * HV, mask=mt, other=0.0)
        # Kᵀ [BK, BT] through transposed strides: the update's and the output's Q Kᵀ
        b_kt = tl.load(
            k + (t0 + rt[None, :]) * KS + i_h * K + rk[:, None],
            mask=mk[:, None] & mt[None, :],
            other=0.0,
        )
        b_h = S.to(k.dtype.element_ty).to(q.dtype.element_ty)  # h_c as stored, as re-read
        b_vo = b_vn.to(U.dtype.element_ty)  # v_new as stored
        dec = tl.where(mt, tl.exp(tl.where(mt, g_last - b_g, 0.0)), 0.0)
        b_vd = (b_vn * dec[:, None]).to(b_kt.dtype)
        S = S * tl.exp(g_last)
        S = tl.dot(b_kt, b_vd, S, input_precision=PREC)

        # ---- chunk_output_fwd's chunk (Q Kᵀ first: its fp32 tile is spent before O's)
        b_q = tl.load(
            q + (t0 + rt[:, None]) * KS + i_h * K + rk[None, :],
            mask=mt[:, None] & mk[None, :],
            other=0.0,
        )
        b_a = tl.dot(b_q, b_kt, input_precision=PREC)
        # (i ≥ j) & (i < n) as one comparison: no loop-invariant [BT, BT] mask kept live
        causal = tl.where(mt, rt, -1)[:, None] >= rt[None, :]
        b_a = tl.where(causal, b_a * tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)),
                       0.0)
        b_o = tl.dot(b_q, b_h, input_precision=PREC)
        b_o = b_o * tl.exp(b_g)[:, None]
        b_o = tl.dot(b_a.to(b_vo.dtype), b_vo, b_o, input_precision=PREC)
        tl.store(
            o + (t0 + rt[:, None]) * HV * V + i_hv * V + rv[None, :],
            (b_o * scale).to(o.dtype.element_ty),
            mask=m_tv,
        )

    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + s_off, S, mask=m_kv)


def chunk_fwd_fused_config(K: int, V: int) -> dict[str, int]:
    """Pinned launch configuration of the fused kernel for head dims ``K, V``.

    ``BK`` covers all of ``K`` (the state's rows live in one tile, as in
    :func:`~gdn_core.ops.chunk_state.chunk_state_config`). ``BV = 64`` for every
    launch: the output's dots are 64 wide as in
    :func:`~gdn_core.ops.output.chunk_output_config` (narrower value blocks are where
    Triton 3.6's multi-dot Hopper code has been wrong, :mod:`gdn_core.ops.tiles`), and
    it depends on ``V`` alone (the bits would not change with it either: value columns
    are independent). Four warps: every dot but the update has 64 rows, one
    warpgroup's ``wgmma`` height — eight warps would compute those tiles twice.

    ``num_stages = 1`` (bf16, K = V = 128, ``tools/sm90_report.py fused_fwd``): 255
    registers, no spills and 56 KiB of shared memory, so two CTAs share an SM and the
    segment path's 8 segments × 16 heads × 2 value blocks = 256 programs are resident
    in one wave on the H200's 132 SMs, each CTA's chain hiding the other's loads. Two
    stages (no spills, 137 KiB) leave one CTA per SM, two waves, and buy no overlap
    (the next chunk's copies are issued after this chunk's dots and waited on at the
    top of the next); three (193 KiB, 4 bytes of spills at group 1) overlap one CTA's
    loads but still run two waves.
    ``benchmarks/fused_fwd_probe.py`` times the alternatives. ``BK = 256`` (the state
    twice as tall) takes eight warps.
    """
    BK = dot_tile(K, 256)
    BV = dot_tile(V, 64)
    num_warps = 4 if BK * BV <= 128 * 64 else 8
    return {"BK": BK, "BV": BV, "num_warps": num_warps, "num_stages": 1}


#: ``BV`` / ``num_warps`` / ``num_stages`` replacing the pinned ones (``None``: none) — for
#: ``benchmarks/fused_fwd_probe.py`` and the tests that the bits do not depend on them;
#: never set by the pipeline
CONFIG_OVERRIDE: dict[str, int] | None = None
_OVERRIDABLE = ("BV", "num_warps", "num_stages")


_CHUNK_FWD_FUSED_KERNEL = cached_launch(_chunk_fwd_fused_kernel)


def check_fused_fwd_shapes(q: torch.Tensor, k: torch.Tensor, W: torch.Tensor,
                           U: torch.Tensor, G: torch.Tensor, index: ChunkIndex,
                           group: int) -> None:
    """The shape checks of the fused forward's launchers (this one and the Gluon
    :func:`~gdn_core.ops.gluon.fused_fwd.chunk_fwd_fused_gluon`): ``q, k`` ``[T, H, K]``,
    ``W`` ``[T, HV, K]``, ``U`` ``[T, HV, ·]``, ``G`` ``[T, HV]``, ``HV = H · group``, ``T``
    the index's tokens.

    Raises:
        ValueError: a shape that does not match (``"shape mismatch: …"``).
    """
    T, H, K = k.shape
    HV = U.shape[1]
    if (
        tuple(q.shape) != (T, H, K)
        or tuple(W.shape) != (T, HV, K)
        or U.shape[0] != T
        or HV != H * group
        or tuple(G.shape) != (T, HV)
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, W {tuple(W.shape)}, "
            f"U {tuple(U.shape)}, G {tuple(G.shape)}, group {group}, "
            f"index tokens {index.total_tokens}"
        )


@launcher(uses_atomics=False, kernels=(_chunk_fwd_fused_kernel,))
def chunk_fwd_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk recurrence and output of every document in one launch.

    The bits of ``chunk_output_fwd(q, k, *chunk_state_fwd(k, W, U, G, index, group,
    initial_state, output_final_state)[:2], G, scale, index, group)`` and that call's
    final state (see the module docstring for the interpreter at ``K > 64``).

    Args:
        q, k: ``[T, H, K]`` (one dtype), head ``hv // group`` serves value head ``hv``.
        W: ``[T, HV, K]`` from :func:`~gdn_core.ops.wy.wy_fwd` (``k``'s dtype).
        U: ``[T, HV, V]`` from :func:`~gdn_core.ops.wy.wy_fwd`.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g``.
        scale: the output scale.
        index: the chunk table.
        group: value heads per key head.
        initial_state: ``[N, HV, K, V]`` (read as fp32) or ``None`` (zeros).
        output_final_state: return the state after each document.

    Returns:
        ``(o, final)``: ``o: [T, HV, V]`` in ``q``'s dtype, ``final: [N, HV, K, V]`` fp32
        or ``None``. A zero-length document's final state is its initial state (or zeros).

    Raises:
        ValueError: on mismatched shapes or dtypes, or ``K``/``V`` not a multiple of 16
            in ``[16, 256]``.
    """
    check_fused_fwd_shapes(q, k, W, U, G, index, group)
    T, H, K = k.shape
    HV, V = U.shape[1], U.shape[2]
    N = index.num_docs
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    for name, d in (("K", K), ("V", V)):
        if d % 16 != 0 or not 16 <= d <= 256:
            raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, "
                f"got {tuple(initial_state.shape)}"
            )
        initial_state = initial_state.to(torch.float32).contiguous()
    q, k, W, U, G = (x.contiguous() for x in (q, k, W, U, G))
    if G.dtype != torch.float32:
        G = G.float()
    dev = k.device
    o = torch.empty(T, HV, V, dtype=q.dtype, device=dev)
    final = None
    if output_final_state:
        final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if N == 0 or HV == 0:
        return o, final
    if T == 0:  # every document is empty: the state passes through
        if final is not None:
            if initial_state is not None:
                final.copy_(initial_state)
            else:
                final.zero_()
        return o, final
    cfg = chunk_fwd_fused_config(K, V)
    if CONFIG_OVERRIDE:
        cfg.update({key: CONFIG_OVERRIDE[key] for key in _OVERRIDABLE if key in CONFIG_OVERRIDE})
    order = ordered_docs(index)
    grid = doc_grid(triton.cdiv(V, cfg["BV"]), N, HV, order)
    _CHUNK_FWD_FUSED_KERNEL[grid](
        q, k, W, U, G, initial_state, o, final, index.doc_offsets, order, float(scale),
        ORDERED=order is not None, H=H, HV=HV,
        GROUP=group, K=K, V=V, BT=index.chunk_size, BK=cfg["BK"], BV=cfg["BV"],
        USE_H0=initial_state is not None, STORE_FINAL=output_final_state,
        PREC="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, final
