"""Stage 3, the chunk-state recurrence, in Gluon for Hopper (sm_90a): opt-in, K = V = 128.

Same arguments and results as :func:`gdn_core.ops.chunk_state.chunk_state_fwd` for its
fast case — K = V = 128, chunks of 64, ``k``/``W``/``U`` of one 16-bit dtype, the plain
state (no ``state_width``, ``identity_state`` or ``need``: the segment summaries'
``[E | M]`` state stays on the Triton kernel) — walking each document's chunks in
order with the state ``S`` (``[K, BV]``) an fp32 ``warpgroup_mma`` accumulator::

    h_c = bf16(S)                                     (stored)
    V'  = U − W h_c                                   (stored as v_new)
    S  ← exp(G_last) S + K̃ᵀ bf16(V'),   K̃ = bf16(K ⊙ exp(G_last − G))

One CTA (one warpgroup, 4 warps) per (value block of ``BV`` columns, document, value
head), grid ``(V / BV, N, HV)`` as the Triton kernel's. Value columns are independent
(every product contracts over K or over the chunk's rows, never over value columns), so
a column's bits do not depend on ``BV``, nor a document's on the other documents.

The chain of one chunk and what runs beside it:

1. ``S`` → bf16 → the shared tile ``s_s`` ``[K, BV]`` (fence, CTA barrier). That tile
   is ``h_c``: a TMA store sends it to ``h`` (asynchronous, off the chain) and it is the
   B operand of the next product.
2. ``P = W h_c`` (``warpgroup_mma`` m64nBVk16, W from the ring). While it runs: the
   refill of the ring's K slot of the previous chunk; ``K̃`` formed in place in the
   ring's K tile (rows ``≥ n`` set to 0); ``S ← exp(G_last) S`` in registers; U's tile
   loaded into P's accumulator layout.
3. ``V' = U − P`` with rows ``≥ n`` set to 0 → bf16 → the shared tile ``vn_s``
   ``[64, BV]`` (fence, barrier): the B operand of the next product and, for a full
   chunk, the source of v_new's TMA store (a short chunk, the last of a document,
   stores rows ``< n`` from registers: a TMA box would write the next document's rows).
   The ring's W and U slots are spent: the chunk ``c + STAGES``'s copies are issued.
4. ``S ← S + K̃ᵀ V'`` (``warpgroup_mma`` with A = the K̃ tile permuted, M = 128 as two
   m64 instructions, K = 64).

The next chunks' K, W and U tiles come by TMA into a ring of ``STAGES`` shared-memory
slots (an mbarrier per slot for W + U, one for K: K is read last, so its slot is
refilled a step later), issued ``STAGES`` chunks ahead; ``G`` of the next chunk is
loaded into registers one chunk ahead. At BV = 64, two slots are 80 KiB and the
kernel's shared memory about 104 KiB: two CTAs per SM (the 256 programs of 8 documents
× 16 heads × 2 blocks fit one wave on the H200's 132 SMs; the Triton kernel at three
stages runs one CTA per SM, two waves).

Short chunks and document boundaries. TMA reads whole 64-row tiles, so a document's
last chunk (``n < 64``) holds the next document's rows (zeros past ``T``). They never
reach a valid value: rows of ``P = W h_c`` are independent, and V' rows ``≥ n`` are
set to 0 by a select (not a product: a NaN there stays out), as are K̃ rows ``≥ n``,
before ``K̃ᵀ V'`` contracts over rows; ``G`` is loaded masked and v_new's rows ``≥ n``
are never written. Each program's arithmetic is a function of its own document.

Numerics against the Triton kernel: both store ``h_c = bf16(S)`` and form ``W h_c`` in
fp32 from bf16 operands; the Triton kernel rounds ``V' ⊙ exp(G_last − G)`` to 16 bits
for the update, this kernel rounds V' (the stored v_new) and ``K ⊙ exp(G_last − G)``:
not the same bits, within bf16 tolerance of both and of the fp32 reference.

Determinism: no atomics, each output owned by one CTA, the wgmma K loops fixed: two
calls give the same bits. Registered with :func:`gdn_core.ops.registry.launcher`
(``uses_atomics=False``); ``tools/check_kernel_determinism.py`` scans ``@gluon.jit``
kernels for atomics.

Compiled for sm_90a with Triton 3.6 on a machine without a GPU, not yet run on one
(``PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/sm90_report.py gluon_state``;
bf16, h0/h/v_new/final all on, group 1 | group 2)::

    BV=64,  2 slots (launcher, >= 128 programs): 227 | 225 registers, 0 spills,
                                                 106,528 B shared, 1,696 SASS
    BV=64,  3 slots: 239 | 237 registers, 0 spills, 147,512 B, 1,808 | 1,800 SASS
    BV=32,  2 slots (launcher, < 128 programs):  141 registers, 0 spills, 86,048 B
    BV=128, 2 slots (probe only): 255 registers, 8 | 4 B spills, 147,488 B

against the Triton ``_chunk_state_fwd_kernel`` (BV=64, 4 warps, 3 stages): 255 | 250
registers, 0 spills, 139,784 B shared (one CTA per SM), 2,328 | 2,304 SASS. Per chunk the
PTX has 16 ``wgmma.mma_async`` m64n64k16 (8 for ``W h_c``, 2 × 4 for the update), two
``wgmma.wait_group``, 8 + 4 ``stmatrix`` (h_c, V'), four ``bar.sync`` on the chain's
path (after h_c, after V', and two while the products run) plus the membar pass's
syncs around the refills (issued after the products, off the chain).
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.chunk_state import chunk_state_config
from gdn_core.ops.gluon.lang import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    require_sm90,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from gdn_core.ops.gluon.tma import descriptor, rows_view
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["GLUON_STATE_BV", "GLUON_STATE_STAGES", "chunk_state_fwd_gluon",
           "gluon_chunk_state_supported"]


#: Value columns per program: ``None`` follows :func:`chunk_state_config` (64 from 128
#: programs on, else 32); 32, 64 or 128 pin it (the probe's knob; the bits do not change).
GLUON_STATE_BV: int | None = None
#: Ring slots of K/W/U tiles (2: two CTAs per SM at BV <= 64; 3 fits one CTA per SM).
GLUON_STATE_STAGES = 2
_WARPS = 4
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _load_wu(w_desc, u_desc, bar, w_s, u_s, slot, t0, tw, tu):
    """W's and U's tiles of the chunk at token ``t0`` into ring slot ``slot``."""
    b = bar.index(slot)
    mbarrier.expect(b, w_desc.block_type.nbytes + u_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [t0, tw], b, w_s.index(slot))
    tma.async_copy_global_to_shared(u_desc, [t0, tu], b, u_s.index(slot))


@gluon.jit
def _load_k(k_desc, bar, k_s, slot, t0, tk):
    """K's tile of the chunk at token ``t0`` into ring slot ``slot``."""
    b = bar.index(slot)
    mbarrier.expect(b, k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [t0, tk], b, k_s.index(slot))


@gluon.jit
def _load_g(G, bos, eos, ic, HV, i_hv, rt, BT: gl.constexpr):
    """Raw ``G`` rows (masked to the chunk, 0 past it) and ``G_last`` of chunk ``ic``; a
    chunk past the document reads ``G[eos - 1]`` and no rows (the one-ahead prefetch)."""
    t0 = bos + ic * BT
    n = gl.minimum(eos - t0, BT)
    t_last = gl.maximum(gl.minimum(t0 + BT, eos) - 1, 0)  # an empty document at 0: G[0]
    g_last = gl.load(G + (t_last.to(gl.int64) * HV + i_hv))
    g = gl.load(G + ((t0 + rt).to(gl.int64) * HV + i_hv), mask=rt < n, other=0.0)
    return g, g_last


@gluon.jit
def _chunk_state_fwd_gluon_kernel(
    k_desc, w_desc, u_desc, h_desc, v_desc,
    G, h0, v_new, ht, doc_offsets, doc_chunk_offsets, HV,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    BV: gl.constexpr, STAGES: gl.constexpr, USE_H0: gl.constexpr, STORE_H: gl.constexpr,
    STORE_VNEW: gl.constexpr, STORE_FINAL: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 4)
    i_v = gl.program_id(0)
    i_n = gl.program_id(1)
    i_hv = gl.program_id(2)
    i_h = i_hv // GROUP
    bos = gl.load(doc_offsets + i_n)
    eos = gl.load(doc_offsets + i_n + 1)
    c0 = gl.load(doc_chunk_offsets + i_n)
    n_chunks = gl.cdiv(eos - bos, BT)
    dtype: gl.constexpr = k_desc.dtype

    # --- layouts: S [K, BV] and P / V' [BT, BV] as wgmma accumulators (m64nBVk16; S's 128
    # rows are two m64 repetitions); the K tile's in-place pass in 16-byte vectors
    SL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    RS: gl.constexpr = gl.SliceLayout(1, SL)
    CS: gl.constexpr = gl.SliceLayout(0, SL)
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1], order=[1, 0])
    RIO: gl.constexpr = gl.SliceLayout(1, IO)

    # --- shared memory: the ring of K/W/U tiles, h_c's and V''s bf16 tiles
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], k_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], w_desc.layout)
    u_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BV], u_desc.layout)
    s_s = gl.allocate_shared_memory(dtype, [K, BV], h_desc.layout)
    vn_s = gl.allocate_shared_memory(dtype, [BT, BV], v_desc.layout)
    bar_wu = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bar_wu.index(i), count=1)
        mbarrier.init(bar_k.index(i), count=1)
    fence_async_shared()

    tk = i_h * K
    tw = i_hv * K
    tu = i_hv * V + i_v * BV
    for i in gl.static_range(STAGES):
        if i < n_chunks:
            _load_wu(w_desc, u_desc, bar_wu, w_s, u_s, i, bos + i * BT, tw, tu)
            _load_k(k_desc, bar_k, k_s, i, bos + i * BT, tk)

    rk = gl.arange(0, K, layout=RS)
    rv = gl.arange(0, BV, layout=CS)
    rows = gl.arange(0, BT, layout=RS)
    rt = gl.arange(0, BT, layout=RIO)
    s_off = rk[:, None] * V + (i_v * BV + rv)[None, :]
    st_base = (i_n * HV + i_hv).to(gl.int64) * (K * V)
    if USE_H0:
        S = gl.load(h0 + st_base + s_off)
    else:
        S = gl.zeros([K, BV], gl.float32, SL)
    zp = gl.zeros([BT, BV], gl.float32, SL)
    g_nx, gl_nx = _load_g(G, bos, eos, 0, HV, i_hv, rt, BT)

    for ic in range(0, n_chunks):
        slot = ic % STAGES
        phase = (ic // STAGES) & 1
        t0 = bos + ic * BT
        n = gl.minimum(eos - t0, BT)
        g_c = g_nx
        g_last = gl_nx
        g_nx, gl_nx = _load_g(G, bos, eos, ic + 1, HV, i_hv, rt, BT)

        # (1) h_c = bf16(S): the B operand of W h_c and the stored state
        s_s.store(S.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        if STORE_H:
            tma.async_copy_shared_to_global(h_desc, [((c0 + ic) * HV + i_hv) * K, i_v * BV], s_s)

        # (2) P = W h_c; meanwhile the K refill, K~ in place, S's decay, U's tile
        mbarrier.wait(bar_wu.index(slot), phase)
        p = warpgroup_mma(w_s.index(slot), s_s, zp, use_acc=False, is_async=True)
        nk = ic - 1 + STAGES  # the previous chunk's K slot is free (its update was waited)
        if (ic >= 1) & (nk < n_chunks):
            _load_k(k_desc, bar_k, k_s, (ic - 1) % STAGES, bos + nk * BT, tk)
        if STORE_VNEW:
            tma.store_wait(1 if STORE_H else 0)  # the previous v_new store has read vn_s
            gl.thread_barrier()
        mbarrier.wait(bar_k.index(slot), phase)
        in_c = rt < n
        dec = gl.where(in_c, gl.exp(gl.where(in_c, g_last - g_c, 0.0)), 0.0)
        kt = k_s.index(slot).load(IO)
        kt = gl.where(in_c[:, None], (kt.to(gl.float32) * dec[:, None]).to(dtype),
                      gl.zeros_like(kt))
        k_s.index(slot).store(kt)
        S = S * gl.exp(g_last)
        u = u_s.index(slot).load(SL).to(gl.float32)
        p = warpgroup_mma_wait(0, deps=[p, w_s.index(slot), s_s])[0]

        # (3) V' = U - P, rows >= n zero (selected, not multiplied)
        vn = gl.where((rows < n)[:, None], u - p, 0.0)
        vn_s.store(vn.to(dtype))
        fence_async_shared()
        gl.thread_barrier()

        # (4) S += K~ᵀ V'; meanwhile v_new's store, the W/U refill
        S = warpgroup_mma(k_s.index(slot).permute((1, 0)), vn_s, S, is_async=True)
        if ic + STAGES < n_chunks:  # this chunk's W and U slots are spent
            _load_wu(w_desc, u_desc, bar_wu, w_s, u_s, slot, bos + (ic + STAGES) * BT, tw, tu)
        if STORE_VNEW:
            if n == BT:
                tma.async_copy_shared_to_global(v_desc, [t0, tu], vn_s)
            else:  # a document's short last chunk: rows < n only
                offs = (t0 + rows).to(gl.int64)[:, None] * (HV * V) + (tu + rv)[None, :]
                gl.store(v_new + offs, vn.to(dtype), mask=(rows < n)[:, None] & (rv < BV)[None, :])
        if STORE_H:
            tma.store_wait(1 if STORE_VNEW else 0)  # h_c's store has read s_s
            gl.thread_barrier()
        S = warpgroup_mma_wait(0, deps=[S, k_s.index(slot), vn_s])[0]

    if STORE_H or STORE_VNEW:
        tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bar_wu.index(i))
        mbarrier.invalidate(bar_k.index(i))
    if STORE_FINAL:
        # offsets formed anew (another association than s_off's), so that they are not
        # the pre-loop tensor kept live across the loop (64 registers a thread at BV = 64)
        p_t = ht + st_base + (i_v * BV)
        gl.store(p_t + ((rk * V)[:, None] + rv[None, :]), S)


_CHUNK_STATE_FWD_GLUON_KERNEL = cached_launch(_chunk_state_fwd_gluon_kernel)


def gluon_chunk_state_supported(
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    index: ChunkIndex,
    *,
    state_width: int | None = None,
    identity_state: bool = False,
    need: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`chunk_state_fwd_gluon` serves these inputs (the device is not
    checked): K = V = 128, chunks of 64, ``k``/``W``/``U`` of one 16-bit dtype, the plain
    state (``state_width`` absent or ``U``'s width, no ``identity_state``, no ``need``)."""
    return (k.shape[-1] == _K and U.shape[-1] == _V and index.chunk_size == _BT
            and k.dtype in (torch.bfloat16, torch.float16)
            and W.dtype == k.dtype and U.dtype == k.dtype
            and (state_width is None or int(state_width) == U.shape[-1])
            and not identity_state and need is None)


def _require_gluon_sm90(device: torch.device) -> None:
    require_sm90(device, "the Gluon chunk-state kernel")


def _block_v(programs: int) -> int:
    bv = GLUON_STATE_BV if GLUON_STATE_BV is not None else chunk_state_config(
        _K, _V, 2, programs=programs)["BV"]
    if bv not in (32, 64, 128):
        raise ValueError(f"GLUON_STATE_BV must be 32, 64 or 128, got {bv}")
    return bv


def _descriptors(k, W, U, h, v_new, BV: int) -> dict:
    """TMA descriptors over the 2-D views the kernel tiles (CPU tensors suffice, for
    :mod:`tools.sm90_report`); without ``h`` / ``v_new`` (not stored) a descriptor of the
    same block over ``k`` / ``U`` stands in (never used)."""
    K = k.shape[-1]
    u_desc = descriptor(U, [_BT, BV])
    return dict(
        k_desc=descriptor(k, [_BT, K]),
        w_desc=descriptor(W, [_BT, K]),
        u_desc=u_desc,
        h_desc=descriptor(rows_view(h.flatten(0, 2)) if h is not None else rows_view(k),
                          [K, BV]),
        v_desc=descriptor(v_new, [_BT, BV]) if v_new is not None else u_desc,
    )


@launcher(uses_atomics=False, kernels=(_chunk_state_fwd_gluon_kernel,))
def chunk_state_fwd_gluon(
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
    """The chunk-state recurrence by the Gluon kernel (opt-in; the Triton kernel is the
    default): a drop-in for :func:`gdn_core.ops.chunk_state.chunk_state_fwd`.

    Args:
        k: ``[T, H, 128]`` bf16 or fp16; head ``hv // group`` serves value head ``hv``.
        W: ``[T, HV, 128]``, U: ``[T, HV, 128]`` from :func:`wy_fwd`, in k's dtype.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (another float dtype is cast).
        index: the chunk table (chunks of 64 tokens).
        group: value heads per key head.
        initial_state: ``[N, HV, 128, 128]`` (read as fp32) or ``None`` (zeros).
        output_final_state, store_states, store_v_new: as :func:`chunk_state_fwd`.
        state_width, identity_state, need: only their defaults (or ``state_width`` equal
            to U's width); the extended state is the Triton kernel's.

    Returns:
        ``(h [NT, HV, K, V] in k's dtype or None, v_new [T, HV, V] in U's dtype or None,
        final [N, HV, K, V] fp32 or None)``.

    Raises:
        ValueError: shapes that do not match (as :func:`chunk_state_fwd`), K or V not
            128, chunks not of 64, dtypes not one 16-bit type, the extended state or
            ``need``, a bad ``initial_state`` shape, or more rows than TMA's int32
            coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    T, H, K = k.shape
    HV, V = U.shape[1], U.shape[2]
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
    if (K, V) != (_K, _V) or index.chunk_size != _BT:
        raise ValueError(f"the Gluon chunk-state kernel serves K = V = {_K} and chunks of "
                         f"{_BT}, got K={K}, V={V}, chunk size {index.chunk_size}")
    if k.dtype not in (torch.bfloat16, torch.float16) or W.dtype != k.dtype or U.dtype != k.dtype:
        raise ValueError(f"the Gluon chunk-state kernel takes k, W, U in one 16-bit dtype, got "
                         f"{k.dtype}, {W.dtype}, {U.dtype}")
    if (state_width is not None and int(state_width) != V) or identity_state or need is not None:
        raise ValueError("the Gluon chunk-state kernel serves the plain state only (no "
                         "state_width != U's width, identity_state or need): use "
                         "chunk_state_fwd")
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, "
                         f"got {tuple(initial_state.shape)}")
    if max(T, NT * HV * K) >= 2**31:
        raise ValueError(f"T={T} / NT*HV*K={NT * HV * K} exceed TMA's int32 coordinates")
    BV = _block_v(N * HV)
    _require_gluon_sm90(k.device)
    dev = k.device
    h = torch.empty(NT, HV, K, V, dtype=k.dtype, device=dev) if store_states else None
    v_new = torch.empty(T, HV, V, dtype=U.dtype, device=dev) if store_v_new else None
    final = (torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
             if output_final_state else None)
    if N == 0 or HV == 0:
        return h, v_new, final
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    if T == 0:  # every document is empty: the state passes through
        if final is not None and initial_state is not None:
            final.copy_(initial_state)
        elif final is not None:
            final.zero_()
        return h, v_new, final
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    descs = _descriptors(k, W, U, h, v_new, BV)
    _CHUNK_STATE_FWD_GLUON_KERNEL[(V // BV, N, HV)](
        *descs.values(), G, initial_state, v_new if v_new is not None else U, final,
        index.doc_offsets, index.doc_chunk_offsets, HV,
        GROUP=group, K=K, V=V, BT=_BT, BV=BV, STAGES=GLUON_STATE_STAGES,
        USE_H0=initial_state is not None, STORE_H=store_states, STORE_VNEW=store_v_new,
        STORE_FINAL=output_final_state, num_warps=_WARPS,
    )
    return h, v_new, final
