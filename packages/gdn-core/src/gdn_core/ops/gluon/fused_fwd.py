"""The forward's last phase warp-specialised, in Gluon for Hopper (sm_90a): stage
``fused_fwd`` (a default stage since session 21), K = V = 128, chunks of 64, 16-bit inputs.

A drop-in for :func:`gdn_core.ops.chunk_fwd_fused.chunk_fwd_fused` (same arguments, same
results): the chunk-state recurrence and the chunk output of every document in one launch,
the state ``S`` (``[K, V]`` fp32) never in memory. Per chunk (the Triton kernel's statements,
roundings and order)::

    h_c = round(S)                                           (the output's and W's operand)
    V'  = U − W h_c;  vo = round(V');  vd = round(V' ⊙ exp(G_last − G))
    S  ← exp(G_last) S + Kᵀ vd
    A   = where(i ≥ j, (Q Kᵀ) ⊙ exp(G_i − G_j), 0)
    O   = round(scale · ((Q h_c) ⊙ exp(G) + round(A) vo))

**Why.** The Triton kernel (one program per 64 value columns, 255 registers, two CTAs an
SM) walks the chain and the output in one instruction stream: Nsight Compute on the H200
(session 20, B1 T32768 H16 8 docs) had it issuing on 24 % of cycles at 12 % occupancy,
0.35 ms a step, latency-bound. Here one CTA owns a (document, value head) with all 128
value columns and splits it:

* **S** (default partition, 8 warps = two warpgroups, each owning 64 rows of ``S``): the
  chain — ``h_c`` published to a shared tile, ``P = W h_c`` (each warpgroup 64 of its
  columns), ``V'``, ``vo`` published, ``vd`` written over the chunk's spent U tile,
  ``S ← exp(G_last) S + Kᵀ vd`` (M = 128 over the two warpgroups); it also issues every TMA
  load (q, k, W, U of a chunk into a ring of :data:`GLUON_FUSED_FWD_STAGES` stages) and, for
  a document's short last chunk, zeroes K's rows past the chunk before anything reads them.
* **O** (worker, 4 warps): the output of the chunk whose ``h_c`` S has published —
  ``Q Kᵀ``, ``Q h_c``, then ``round(A) vo`` once ``vo`` is published — and its store (TMA
  for a full chunk, masked rows for a short one). Its products run beside S's next ones.

**Hand-offs** (mbarriers, phase = chunk & 1): ``ld_ready[s]`` (S's expect-tx; S and O wait),
``h_ready`` and ``vo_ready`` (S → O), ``o_free`` (O → S: chunk ``c``'s ``h_c``, ``vo`` and q/k
tiles are read; S waits on it before publishing ``h_{c+1}`` and refilling the stage). Every
arrival follows ``fence_async_shared`` and the partition's ``thread_barrier``.

**Bits.** Each product is the same ``warpgroup_mma`` sequence (k16 steps in order into one
fp32 accumulator, the same operands) as the Triton kernel's ``tl.dot`` on sm_90, the
elementwise statements are its own, and value columns are independent — so the results are
meant to be bitwise the Triton kernel's; ``tests/test_gluon_fused_fwd_gpu.py`` checks it on
the H200.

**Short chunks.** Only a document's last chunk can be short (``n < 64``). TMA reads whole
tiles, so its rows ``≥ n`` hold the next document's rows (zeros past ``T``): S zeroes K's
(the update contracts over rows: ``0 · NaN`` must not happen); ``V'``'s rows are selected to
0; ``A``'s rows and columns ``≥ n`` are selected away; O stores rows ``< n`` only; ``G``
is loaded masked. So a document's results depend on its own rows only.

Shared memory (bf16): the ring 2 × (q, k, W, U) = 128 KiB, ``h_c`` 32 KiB, ``vo`` 16 KiB,
the output's staging tile 16 KiB: ≈ 192 KiB, one CTA an SM. Determinism: no atomics, one
CTA owns each output, every reduction in a fixed order.

Compiled for sm_90a with Triton 3.6 (``PYTHONPATH=/tmp/t36:packages/gdn-core/src python
tools/sm90_report.py gluon_fused_fwd``, bf16, group 1 and 2 alike)::

    setmaxnreg S 176 / O 152 (12 warps at maxnreg 168), 4 B of spills, 196,924 B shared,
    2,032 SASS, 42 bar.sync, 32 wgmma

On the H200 (session 21, ``benchmarks/fused_fwd_probe.py --docs 1,8 --variants "" --gluon``,
B1 T32768 H16, segments of 4096): the Triton kernel's bits (``o`` and the final states),
repeatable, in 0.197 against 0.348 ms (one document) and 0.214 against 0.361 ms (8).
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex, ordered_docs
from gdn_core.ops.chunk_fwd_fused import check_fused_fwd_shapes
from gdn_core.ops.gluon.fused_state_bwd import _doc_program, _doc_span
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
from gdn_core.ops.gluon.tma import descriptor
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["GLUON_FUSED_FWD_O_REGS", "GLUON_FUSED_FWD_STAGES", "chunk_fwd_fused_gluon",
           "gluon_fused_fwd_supported"]

#: TMA ring stages (q, k, W, U of one chunk: 64 KiB a stage)
GLUON_FUSED_FWD_STAGES = 2
#: registers of partition O (4 warps); S (8 warps) gets ``(3 · 168 − O) / 2``
GLUON_FUSED_FWD_O_REGS = 152
_MAXNREG = 168  # 12 warps · 32 threads · 168 ≤ 64 K
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _issue(q_desc, k_desc, w_desc, u_desc, bar, q_s, k_s, w_s, u_s, t0, tq, tw):
    """The four TMA loads of one chunk into one ring stage, on its mbarrier."""
    mbarrier.expect(bar, 4 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [t0, tq], bar, q_s)
    tma.async_copy_global_to_shared(k_desc, [t0, tq], bar, k_s)
    tma.async_copy_global_to_shared(w_desc, [t0, tw], bar, w_s)
    tma.async_copy_global_to_shared(u_desc, [t0, tw], bar, u_s)


@gluon.jit
def _chain_values(w_t, h_s, u_t, vo_s, S, g, g_last, rows, n, zp, PL: gl.constexpr):
    """The middle of one chunk's chain step, once ``h_c`` is published in ``h_s``:
    ``P = W h_c`` (W the tile ``w_t``) beside ``S ← e^{G_last} S``; ``V' = U − P`` (U the tile
    ``u_t``, rows ``≥ n`` selected to 0); ``vo = round(V')`` into ``vo_s``; ``vd =
    round(V' ⊙ e^{G_last − G})`` over the spent U tile; fenced and CTA-barriered for the
    update's wgmma. Returns ``(S, vo)``. Shared with :mod:`gdn_core.ops.gluon.recompute`."""
    dtype: gl.constexpr = vo_s.dtype
    p = warpgroup_mma(w_t, h_s, zp, use_acc=False, is_async=True)
    S = S * gl.exp(g_last)
    u = u_t.load(PL).to(gl.float32)
    p = warpgroup_mma_wait(0, deps=[p, w_t, h_s])[0]
    vn = gl.where((rows < n)[:, None], u - p, 0.0)
    dec = gl.where(rows < n, gl.exp(gl.where(rows < n, g_last - g, 0.0)), 0.0)
    vo = vn.to(dtype)
    vo_s.store(vo)
    gl.thread_barrier()  # every warp has read its U rows: the tile takes vd
    u_t.store((vn * dec[:, None]).to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    return S, vo


@gluon.jit
def _chain_update(k_t, vd_t, S):
    """``S ← S + Kᵀ vd`` (``S`` already decayed by :func:`_chain_values`), waited."""
    S = warpgroup_mma(k_t.permute((1, 0)), vd_t, S, is_async=True)
    return warpgroup_mma_wait(0, deps=[S, k_t, vd_t])[0]


@gluon.jit
def _zero_rows_from(x_t, n, rio, IO: gl.constexpr):
    """Rows ``≥ n`` of the shared tile ``x_t`` set to 0 (a document's short last chunk:
    its TMA tile holds the next document's rows)."""
    xx = x_t.load(IO)
    x_t.store(gl.where((rio < n)[:, None], xx, gl.zeros_like(xx)))


@gluon.jit
def _chain_partition(q_desc, k_desc, w_desc, u_desc, q_s, k_s, w_s, u_s, h_s, vo_s,
                     ld_ready, h_ready, vo_ready, o_free, G, h0, ht, doc_offsets, i_n, i_hv,
                     HV, tq, tw, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                     STAGES: gl.constexpr, USE_H0: gl.constexpr, STORE_FINAL: gl.constexpr):
    """S (default, 8 warps): the recurrence, the loads, ``h_c`` and ``vo`` published."""
    gl.static_assert(gl.num_warps() == 8)
    dtype: gl.constexpr = q_s.dtype
    # S [K, V]: the two warpgroups own 64 rows each (M = 128 of the update); P, V' [BT, V]:
    # each warpgroup 64 columns
    SL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, V, 16])
    PL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, V // 2, 16])
    RP: gl.constexpr = gl.SliceLayout(1, PL)
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1], order=[1, 0])
    RIO: gl.constexpr = gl.SliceLayout(1, IO)
    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)

    for j in gl.static_range(STAGES):
        if j < n_chunks:
            _issue(q_desc, k_desc, w_desc, u_desc, ld_ready.index(j), q_s.index(j),
                   k_s.index(j), w_s.index(j), u_s.index(j), bos + j * BT, tq, tw)

    rk = gl.arange(0, K, layout=gl.SliceLayout(1, SL))
    cv = gl.arange(0, V, layout=gl.SliceLayout(0, SL))
    st_base = (i_n * HV + i_hv).to(gl.int64) * (K * V)
    if USE_H0:
        S = gl.load(h0 + st_base + rk[:, None] * V + cv[None, :])
    else:
        S = gl.zeros([K, V], gl.float32, SL)
    rows = gl.arange(0, BT, layout=RP)
    rio = gl.arange(0, BT, layout=RIO)
    zp = gl.zeros([BT, V], gl.float32, PL)

    for c in range(0, n_chunks):
        s = c % STAGES
        t0 = bos + c * BT
        n = gl.minimum(eos - t0, BT)
        p_g = G + (t0.to(gl.int64) * HV + i_hv)
        g = gl.load(p_g + rows * HV, mask=rows < n, other=0.0)
        g_last = gl.load(p_g + (n - 1) * HV)
        if c > 0:  # O is done with chunk c-1: h_s, vo_s and that chunk's stage are free
            mbarrier.wait(o_free, (c - 1) & 1)
            if c - 1 + STAGES < n_chunks:
                sp = (c - 1) % STAGES
                _issue(q_desc, k_desc, w_desc, u_desc, ld_ready.index(sp), q_s.index(sp),
                       k_s.index(sp), w_s.index(sp), u_s.index(sp), t0 + (STAGES - 1) * BT,
                       tq, tw)
        mbarrier.wait(ld_ready.index(s), (c // STAGES) & 1)
        if n < BT:  # a document's short last chunk: K's foreign rows to 0 before any read
            _zero_rows_from(k_s.index(s), n, rio, IO)
        # h_c = round(S): W's operand here, Q's in O
        h_s.store(S.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(h_ready, count=1)
        S, _ = _chain_values(w_s.index(s), h_s, u_s.index(s), vo_s, S, g, g_last, rows, n, zp,
                             PL)
        mbarrier.arrive(vo_ready, count=1)
        S = _chain_update(k_s.index(s), u_s.index(s), S)

    if STORE_FINAL:
        zero = gl.load(doc_offsets + i_n + 1) - eos  # offsets formed anew (not kept live)
        gl.store(ht + st_base + (rk + zero)[:, None] * V + cv[None, :], S)


@gluon.jit
def _causal_scores(q_t, k_t, g1, n, ri, cj, AL: gl.constexpr):
    """``A = where(i ≥ j, i < n: (Q Kᵀ) ⊙ e^{G_i − G_j}, 0)`` of one chunk (fp32, layout
    ``AL``; the exponent masked before ``exp``): ``q_t``, ``k_t`` its shared tiles, ``g1``
    its ``G`` (any 1-D layout, 0 past ``n``), ``ri``/``cj`` the row/column indices in
    ``AL``'s slices. Rows or columns ``≥ n`` of K never reach a kept entry."""
    BT: gl.constexpr = q_t.shape[0]
    a = warpgroup_mma(q_t, k_t.permute((1, 0)), gl.zeros([BT, BT], gl.float32, AL),
                      use_acc=False, is_async=True)
    a = warpgroup_mma_wait(0, deps=[a, q_t, k_t])[0]
    g_i = gl.convert_layout(g1, gl.SliceLayout(1, AL))
    g_j = gl.convert_layout(g1, gl.SliceLayout(0, AL))
    causal = gl.where(ri < n, ri, -1)[:, None] >= cj[None, :]
    return gl.where(causal, a * gl.exp(gl.where(causal, g_i[:, None] - g_j[None, :], 0.0)),
                    0.0)


@gluon.jit
def _output_products(q_t, h_s, a, vo_s, vo_ready, phase, g1, A16: gl.constexpr,
                     OL: gl.constexpr):
    """``(Q h_c) ⊙ e^G + round(A) vo`` of one chunk (fp32, layout ``OL``), unscaled:
    ``Q h_c`` issued first, ``A`` (fp32 from :func:`_causal_scores`, or already rounded
    into ``A16``) rounded beside it, then ``vo`` awaited on ``vo_ready`` at ``phase``.
    Waited; the caller barriers before releasing the tiles."""
    BT: gl.constexpr = q_t.shape[0]
    V: gl.constexpr = h_s.shape[1]
    acc = warpgroup_mma(q_t, h_s, gl.zeros([BT, V], gl.float32, OL), use_acc=False,
                        is_async=True)
    a16 = gl.convert_layout(a.to(q_t.dtype), A16)
    acc = warpgroup_mma_wait(0, deps=[acc, q_t, h_s])[0]
    acc = acc * gl.exp(gl.convert_layout(g1, gl.SliceLayout(1, OL)))[:, None]
    mbarrier.wait(vo_ready, phase)
    acc = warpgroup_mma(a16, vo_s, acc, is_async=True)
    return warpgroup_mma_wait(0, deps=[acc, vo_s])[0]


@gluon.jit
def _store_rows_below(o, out, t0, col, n, row_stride, ro, co):
    """Rows ``< n`` of the ``[64, D]`` register tile ``out`` to rows ``t0 + [0, n)``,
    columns ``col + [0, D)`` of ``o`` (row stride ``row_stride``); ``ro``/``co`` its
    row/column indices in ``out``'s layout's slices."""
    offs = (t0 + ro).to(gl.int64)[:, None] * row_stride + (col + co)[None, :]
    gl.store(o + offs, out, mask=(ro < n)[:, None] & (co >= 0)[None, :])


@gluon.jit
def _output_partition(q_s, k_s, h_s, vo_s, o_s, ld_ready, h_ready, vo_ready, o_free, o_desc,
                      G, o, doc_offsets, i_n, i_hv, HV, scale, V: gl.constexpr,
                      BT: gl.constexpr, STAGES: gl.constexpr):
    """O (worker, 4 warps): each chunk's output from the ``h_c`` and ``vo`` S publishes."""
    dtype: gl.constexpr = q_s.dtype
    AL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    OL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
    A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=OL, k_width=2)
    G1: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                        warps_per_cta=[4], order=[0])
    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)
    ri = gl.arange(0, BT, layout=gl.SliceLayout(1, AL))
    cj = gl.arange(0, BT, layout=gl.SliceLayout(0, AL))
    ro = gl.arange(0, BT, layout=gl.SliceLayout(1, OL))
    co = gl.arange(0, V, layout=gl.SliceLayout(0, OL))
    r1 = gl.arange(0, BT, layout=G1)
    tv = i_hv * V
    for c in range(0, n_chunks):
        s = c % STAGES
        t0 = bos + c * BT
        n = gl.minimum(eos - t0, BT)
        g1 = gl.load(G + (t0.to(gl.int64) * HV + i_hv) + r1 * HV, mask=r1 < n, other=0.0)
        mbarrier.wait(ld_ready.index(s), (c // STAGES) & 1)
        mbarrier.wait(h_ready, c & 1)  # h_c published, a short chunk's K rows zeroed
        a = _causal_scores(q_s.index(s), k_s.index(s), g1, n, ri, cj, AL)
        acc = _output_products(q_s.index(s), h_s, a, vo_s, vo_ready, c & 1, g1, A16, OL)
        gl.thread_barrier()  # every warp's products have read q, k, h_c and vo
        mbarrier.arrive(o_free, count=1)
        out = (acc * scale).to(dtype)
        if n == BT:
            tma.store_wait(0)  # the previous chunk's store has read o_s
            gl.thread_barrier()
            o_s.store(out)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(o_desc, [t0, tv], o_s)
        else:  # rows < n only: a TMA box would write the next document's rows
            _store_rows_below(o, out, t0, tv, n, HV * V, ro, co)
    tma.store_wait(0)


@gluon.jit
def _fused_fwd_gluon_kernel(
    q_desc, k_desc, w_desc, u_desc, o_desc, G, h0, o, ht, doc_offsets, doc_order, scale, HV,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    STAGES: gl.constexpr, USE_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
    O_REGS: gl.constexpr, ORDERED: gl.constexpr = False,
):
    gl.static_assert(STAGES >= 1)
    i_hv = gl.program_id(0)
    i_n = _doc_program(doc_order, ORDERED)
    i_h = i_hv // GROUP
    dtype: gl.constexpr = q_desc.dtype

    q_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], k_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], w_desc.layout)
    u_s = gl.allocate_shared_memory(dtype, [STAGES, BT, V], u_desc.layout)  # U, then vd
    h_s = gl.allocate_shared_memory(dtype, [K, V], gl.NVMMASharedLayout.get_default_for(
        [K, V], dtype))
    vo_s = gl.allocate_shared_memory(dtype, [BT, V], u_desc.layout)
    o_s = gl.allocate_shared_memory(dtype, [BT, V], o_desc.layout)
    ld_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    h_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    vo_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    o_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ld_ready.index(i), count=1)
    mbarrier.init(h_ready, count=1)
    mbarrier.init(vo_ready, count=1)
    mbarrier.init(o_free, count=1)
    fence_async_shared()

    tq = i_h * K
    tw = i_hv * K
    gl.warp_specialize([
        (_chain_partition, (q_desc, k_desc, w_desc, u_desc, q_s, k_s, w_s, u_s, h_s, vo_s,
                            ld_ready, h_ready, vo_ready, o_free, G, h0, ht, doc_offsets, i_n,
                            i_hv, HV, tq, tw, K, V, BT, STAGES, USE_H0, STORE_FINAL)),
        (_output_partition, (q_s, k_s, h_s, vo_s, o_s, ld_ready, h_ready, vo_ready, o_free,
                             o_desc, G, o, doc_offsets, i_n, i_hv, HV, scale, V, BT,
                             STAGES)),
    ], [4], [O_REGS])


_FUSED_FWD_GLUON_KERNEL = cached_launch(_fused_fwd_gluon_kernel)


def forward_outputs(q: torch.Tensor, HV: int, N: int, initial_state: torch.Tensor | None,
                    output_final_state: bool, what: str
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """What both Gluon forwards (this one and
    :mod:`~gdn_core.ops.gluon.fused_fwd_formed`) do around their launch, once their inputs
    are checked: ``initial_state``'s shape and TMA's row bound checked, the device checked
    (``what`` names the kernel), ``o`` and ``final`` allocated, the entry state read as
    fp32, and the launches with nothing to walk answered here (no documents or heads; every
    document empty: the state passes through). Returns ``(o, final, initial_state,
    launch)``; ``launch`` False means ``(o, final)`` is already the result.

    Raises:
        ValueError: a bad ``initial_state`` shape, or more rows than TMA's int32
            coordinates address.
        RuntimeError: as :func:`~gdn_core.ops.gluon.lang.require_sm90`.
    """
    T, K, V = q.shape[0], _K, _V
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, "
                         f"got {tuple(initial_state.shape)}")
    if T >= 2**31:
        raise ValueError(f"T={T} exceeds TMA's int32 coordinates")
    require_sm90(q.device, what)
    dev = q.device
    o = torch.empty(T, HV, V, dtype=q.dtype, device=dev)
    final = (torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
             if output_final_state else None)
    if N == 0 or HV == 0:
        return o, final, initial_state, False
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    if T == 0:  # every document is empty: the state passes through
        if final is not None and initial_state is not None:
            final.copy_(initial_state)
        elif final is not None:
            final.zero_()
        return o, final, initial_state, False
    return o, final, initial_state, True


def gluon_fused_fwd_supported(q: torch.Tensor, k: torch.Tensor, W: torch.Tensor,
                              U: torch.Tensor, index: ChunkIndex) -> bool:
    """Whether :func:`chunk_fwd_fused_gluon` serves these shapes and dtypes (the device is
    not checked): K = V = 128, chunks of 64, q, k, W, U of one 16-bit dtype."""
    return (k.shape[-1] == _K and U.shape[-1] == _V and index.chunk_size == _BT
            and k.dtype in (torch.bfloat16, torch.float16)
            and q.dtype == k.dtype and W.dtype == k.dtype and U.dtype == k.dtype)


def _descriptors(q, k, W, U, o) -> dict:
    """TMA descriptors of the ``[64, 128]`` tiles (CPU tensors suffice, for
    :mod:`tools.sm90_report`): q, k of ``[T, H·K]``; W, U, o of ``[T, HV·128]``."""
    return dict(q_desc=descriptor(q, [_BT, _K]),
                k_desc=descriptor(k, [_BT, _K]),
                w_desc=descriptor(W, [_BT, _K]),
                u_desc=descriptor(U, [_BT, _V]),
                o_desc=descriptor(o, [_BT, _V]))


@launcher(uses_atomics=False, kernels=(_fused_fwd_gluon_kernel,))
def chunk_fwd_fused_gluon(
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
    """The chunk recurrence and output of every document, warp-specialised (stage
    ``fused_fwd``): a drop-in for :func:`gdn_core.ops.chunk_fwd_fused.chunk_fwd_fused`.

    Args:
        q, k: ``[T, H, 128]`` bf16 or fp16; head ``hv // group`` serves value head ``hv``.
        W, U: ``[T, HV, 128]`` from the WY stage, in q's dtype.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (another float dtype is cast).
        scale: the output scale.
        index: the chunk table (chunks of 64 tokens).
        group: value heads per key head.
        initial_state: ``[N, HV, 128, 128]`` (read as fp32) or ``None`` (zeros).
        output_final_state: return the state after each document.

    Returns:
        ``(o [T, HV, 128] in q's dtype, final [N, HV, 128, 128] fp32 or None)``; meant to be
        bitwise :func:`~gdn_core.ops.chunk_fwd_fused.chunk_fwd_fused`'s (checked on the GPU).

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks not of 64, the inputs
            not of one 16-bit dtype, a bad ``initial_state`` shape, or more rows than TMA's
            int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    check_fused_fwd_shapes(q, k, W, U, G, index, group)
    T, H, K = k.shape
    HV, V = U.shape[1], U.shape[2]
    N = index.num_docs
    if (K, V) != (_K, _V) or index.chunk_size != _BT:
        raise ValueError(f"the Gluon fused forward serves K = V = {_K} and chunks of {_BT}, "
                         f"got K={K}, V={V}, chunk size {index.chunk_size}")
    if not gluon_fused_fwd_supported(q, k, W, U, index):
        raise ValueError(f"the Gluon fused forward takes q, k, W, U in one 16-bit dtype, got "
                         f"{q.dtype}, {k.dtype}, {W.dtype}, {U.dtype}")
    o, final, initial_state, launch = forward_outputs(
        q, HV, N, initial_state, output_final_state, "the Gluon fused forward")
    if not launch:
        return o, final
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    order = ordered_docs(index)
    _FUSED_FWD_GLUON_KERNEL[(HV, N)](
        *_descriptors(q, k, W, U, o).values(), G, initial_state, o, final,
        index.doc_offsets, index.doc_chunk_offsets if order is None else order,
        float(scale), HV, GROUP=group, K=K, V=V, BT=_BT, STAGES=GLUON_FUSED_FWD_STAGES,
        USE_H0=initial_state is not None, STORE_FINAL=output_final_state,
        O_REGS=GLUON_FUSED_FWD_O_REGS, ORDERED=order is not None, num_warps=8,
        maxnreg=_MAXNREG,
    )
    return o, final
