"""The reverse state recurrence with ``dv_local`` computed inside, warp-specialised, in
Gluon for Hopper (sm_90a): step 1 of ``docs/fused_backward.md`` §3.

Stage ``fused_state`` of :data:`gdn_core.ops.gluon.STAGES` (a default where its launch has
enough programs: :func:`gdn_core.ops.backward.pick_fused_state`), K = V = 128, chunks of 64,
16-bit inputs. One launch replaces
:func:`~gdn_core.ops.dv_local.dv_local_bwd` followed by
:func:`~gdn_core.ops.chunk_state_bwd.chunk_state_bwd`, with the latter's contract less its
``dv_local`` argument: ``dh``, ``dv`` (= ``dV'``), ``dh0``, ``store=False``, ``need``, ``dh0``
aliasing ``dht``. Per document, from ``dS_N = dht`` (or 0), over its chunks in reverse::

    dvl_c  = round(round(scale · (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j])ᵀ) dO)     (today's dv_local)
    dV'_c  = dvl_c + diag(kd) (K_c round(dS_{c+1})),   kd = exp(G_last − G)
    dS_c   = (exp(G_last) dS_{c+1} + Q_cᵀ round(diag(scale Γ) dO_c)) − W_cᵀ round(dV'_c)

**Bits.** Every product is formed by the same ``warpgroup_mma`` instructions, with the same
operands, roundings and accumulation order as the two Gluon kernels it fuses
(:mod:`gdn_core.ops.gluon.dv_local`: ``Pᵀ = K Qᵀ`` one ``m64n64k16`` chain of 8 k-steps, the
masked scale, ``dvl = Pᵀ dO`` 4 k-steps of ``m64n128k16``;
:mod:`gdn_core.ops.gluon.chunk_state_bwd`:
the transposed chain ``Xᵀ = dSᵀ Kᵀ``, then ``exp(G_last) dSᵀ``, the Q term and the W term on
one accumulator), and those were measured bitwise equal to the Triton kernels on the H200
(``benchmarks/results/2026-12-02-h200-s13-call1-gluon-probes.txt``). So ``dh``, ``dV'`` and
``dh0`` are meant to be bitwise equal to ``dv_local_bwd`` + ``chunk_state_bwd`` (Triton or
Gluon); the GPU test checks it (``tests/test_gluon_fused_state_bwd_gpu.py``).

**Grid and partitions.** One CTA per (document, value head) owns the whole 128×128 ``dSᵀ``
in fp32 registers; ``gl.warp_specialize`` splits it into two partitions (three
warpgroups, 12 warps):

* **S** (default, 8 warps = two warpgroups, each owning 64 value columns of ``dSᵀ``): the
  recurrence of :mod:`~gdn_core.ops.gluon.chunk_state_bwd` statement for statement, reading
  ``dvl`` from a shared tile A fills instead of from global memory; the ``dh`` / ``dV'``
  stores (TMA, or masked register stores for a short chunk) and ``dh0``. It also zeroes a
  short first chunk's foreign rows of Q, K, W, dO in shared memory, before A reads them,
  and issues the TMA loads of Q, K, W, dO of every chunk into a ring of ``STAGES`` stages:
  the first ``STAGES`` before the loop, then the stage of chunk ``c − 1`` refilled with
  chunk ``c − 1 + STAGES`` right after chunk ``c``'s first two MMAs are issued (behind
  them, off the chain). A is done with that stage by then: its MMAs on it were waited
  before its ``dvl_ready`` arrival for chunk ``c − 1``, which S waited on.
* **A** (worker, 4 warps, one warpgroup): ``dv_local`` of each chunk, as
  :mod:`~gdn_core.ops.gluon.dv_local` forms it, rounded to the input dtype into a ring of
  ``DSTAGES`` ``[64, 128]`` shared tiles. It runs up to ``DSTAGES`` chunks ahead of S, so
  its products are off S's chain.

**mbarriers** (each completes once per use of its slot; phase = use count & 1):
``ld_ready[s]`` (S's expect-tx; S and A wait on it), ``dvl_ready[b]`` (A → S),
``dvl_free[b]`` (S → A) and ``zero_bar`` (S → A, once: the first chunk's tiles are final).
Every arrival from a multi-warp partition follows ``fence_async_shared`` (where a generic
shared access precedes an async one) and the partition-local ``thread_barrier``.

**Short chunks.** Only a document's last chunk (the first processed) can be short: S
zeroes its rows ``≥ n`` of Q, K, W, dO (a ``where``, so NaN is cleared too) before A or
the chain read them; A masks ``Pᵀ`` as the dv_local kernel does (its rows ``≥ n`` come out
zero), and S selects ``dvl``'s rows ``≥ n`` to +0 (the value the state kernel's zeroed
``dv_local`` rows have). Nothing is stored past ``n``. So a document's results depend on
its own rows only.

What is done (step 1 of the design, less its probes' L2-resident variant and clock
stamps): the partitions, both rings, all hand-offs, the complete math and every
output of ``chunk_state_bwd``'s contract. What is not: the design's four-partition split
with a 4-warp S (step 2 needs the registers; here S keeps the two-warpgroup transposed
state of the proven kernel), the ``h``/``v_new``/``A_inv`` tiles and the chunk gradients
(step 2). Run on the H200 since session 16 (bits equal to both pairs; session 17 end to
end). Compiled for sm_90a with Triton 3.6 on a machine without a GPU
(``PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/sm90_report.py fused_state``;
bf16, group 1 and 2 alike)::

    store=True:  setmaxnreg S 200 / A 104 (the kernel at maxnreg 168, 12 warps), 16 B spill
                 stores (ptxas; in SASS 2 STL.64 in A, none in S), 213,564 B shared,
                 3,624 SASS instructions (3,632 at group 2), 28 wgmma, 43 bar.sync
    store=False: the same budgets, 16 B spills (A's); with the first pass's 3-stage
                 ring (session 18) 229,964 B shared, 3,312 SASS, 48 bar.sync (2 stages:
                 164,412 B, 3,136 SASS)

Before (session 15's first version: P a third partition of 1 warp at 24 registers, 16
warps at maxnreg 128, S / A / P = 192 / 104 / 24): store=True 144 B of spill stores (25
STL in A, 11 in S, on S's chain), 213,328 B shared, 4,048 SASS, 34 bar.sync; store=False
84 B (A's), 164,176 B, 3,592 SASS. Nearly all of those spills were loop-invariant 64-bit
offsets of the ``G`` gathers (``tok·HV``, ``ci·HV``, ``rj·HV``: one address a value in
the MMA layouts, 16-18 per thread, hoisted and spilled); ``G`` is now loaded one value a
thread and ``convert_layout``-ed (through shared memory) into the layouts the math uses,
the same values. Folding P into S (no 1-warp warpgroup padded to 4) gives S 200 where 16
warps gave 192: ``2·S + A ≤ 3·168``. A spills its last 16 B at 104 (the RS-wgmma operand
``p`` around its first k-step) and none at 112, but then S gets 192 and spills 96 B with
``store``; S reads ``dvl`` as 16-bit already (a bf16 ``ldmatrix`` of the ring). The
bar.sync count rose with the ``convert_layout`` s (2 a chunk in S, 2 in A) and the
barriers Triton's membar pass puts between the four TMA copies of a stage (4 a chunk in
S, issued behind the chain's first two MMAs); A lost its ``ld_free`` barrier. The
arithmetic of the PTX is unchanged (the same counts of fma/mul/sub/ex2/selp/cvt and wgmma
as before). The non-specialised state kernel takes 255 registers on 8 warps.

**Order of the programs.** Unless ``GDN_CORE_DOC_ORDER=0``
(:data:`gdn_core.switches.DOC_ORDER_ENV`; the default since session 19, whose H200
profile gave 243 against 301 µs a call at 8 documents of the benchmark's lengths) program
``(hv, j)`` takes document
``index.doc_order[j]``, the longest first, so that where the programs outnumber the SMs the
long walks start in the first wave; each program's results depend on its own document
only, so the bits are the same in either order.

Determinism: no atomics, each output tile owned by one CTA, fixed reduction orders.
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex, ordered_docs
from gdn_core.ops.gluon.chunk_state_bwd import _zero_rows, prepare_state_bwd
from gdn_core.ops.gluon.lang import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from gdn_core.ops.gluon.tma import descriptor
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = [
    "GLUON_FUSED_STATE_A_REGS",
    "GLUON_FUSED_STATE_DSTAGES",
    "GLUON_FUSED_STATE_FIRST_PASS_STAGES",
    "GLUON_FUSED_STATE_STAGES",
    "fused_state_bwd_gluon",
    "gluon_fused_state_supported",
]


#: TMA ring stages (Q, K, W, dO of one chunk each: 64 KB a stage) with ``store=True``: the
#: ``dh``/``dV'`` staging tiles (48 KB) leave room for two.
GLUON_FUSED_STATE_STAGES = 2
#: The ring's stages with ``store=False`` (the segment backward's first pass): no staging
#: tiles, so a third stage fits (229,964 B of the 232,448 B a CTA may take). The stage count
#: changes only how far ahead the loads run, never the arithmetic: the same bits.
GLUON_FUSED_STATE_FIRST_PASS_STAGES = 3
#: ``dv_local`` tiles between A and S (16 KB each): how far A may run ahead.
GLUON_FUSED_STATE_DSTAGES = 2
#: Register budget of partition A (4 warps, a multiple of 8); S (8 warps) gets what is left
#: of 168 a thread over the 12 warps (``(3·168 − A) / 2``, rounded down to 8: 200 at 104).
GLUON_FUSED_STATE_A_REGS = 104
_MAXNREG = 168  # 12 warps (8 + 4) · 32 threads · 168 = 64,512 ≤ 64 K
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _doc_span(doc_offsets, i_n, BT: gl.constexpr):
    """``(bos, eos, n_chunks)`` of document ``i_n``."""
    bos = gl.load(doc_offsets + i_n)
    eos = gl.load(doc_offsets + i_n + 1)
    return bos, eos, gl.cdiv(eos - bos, BT)


@gluon.jit
def _doc_program(doc_order, ORDERED: gl.constexpr):
    """The document of this program on a ``(value heads, documents)`` grid: program 1's
    index, or with ``ORDERED`` its entry of ``doc_order`` (the launch's documents longest
    first: the blocks start in grid order). The Gluon twin of
    :func:`gdn_core.ops.doc_walk.doc_program`."""
    if ORDERED:
        return gl.load(doc_order + gl.program_id(1))
    else:
        return gl.program_id(1)


@gluon.jit
def _issue_loads(q_desc, k_desc, w_desc, do_desc, bar, q_s, k_s, w_s, do_s, t0, tk, tw, tv):
    """The four TMA loads of one chunk into one ring stage, on its mbarrier."""
    mbarrier.expect(bar, 3 * q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [t0, tk], bar, k_s)
    tma.async_copy_global_to_shared(q_desc, [t0, tk], bar, q_s)
    tma.async_copy_global_to_shared(w_desc, [t0, tw], bar, w_s)
    tma.async_copy_global_to_shared(do_desc, [t0, tv], bar, do_s)


@gluon.jit
def _dvl_partition(q_s, k_s, do_s, dvl_s, ld_ready, dvl_ready, dvl_free, zero_bar,
                   G, doc_offsets, i_n, i_hv, HV, scale, BT: gl.constexpr, V: gl.constexpr,
                   STAGES: gl.constexpr, DSTAGES: gl.constexpr):
    """A: ``dvl = round(round(scale · (K Qᵀ ⊙ decay ⊙ mask)) dO)`` of every chunk, the
    statements of :mod:`~gdn_core.ops.gluon.dv_local`, into the ``dvl`` ring."""
    dtype: gl.constexpr = q_s.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)
    rj = gl.arange(0, BT, layout=gl.SliceLayout(1, s_layout))
    ci = gl.arange(0, BT, layout=gl.SliceLayout(0, s_layout))
    # G is gathered one value a thread and moved into the MMA layouts (the same values):
    # gathered in those layouts, its 18 hoisted 64-bit offsets a thread spilled
    G1: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                        warps_per_cta=[4], order=[0])
    r1 = gl.arange(0, BT, layout=G1)
    # the first chunk's tiles are read only once S has zeroed a short chunk's foreign rows
    mbarrier.wait(zero_bar, 0, pred=n_chunks > 0)
    for it in range(0, n_chunks):
        s = it % STAGES
        t0 = bos + (n_chunks - 1 - it) * BT
        n = gl.minimum(eos - t0, BT)
        p_g = G + (t0.to(gl.int64) * HV + i_hv)
        g1 = gl.load(p_g + r1 * HV, mask=r1 < n, other=0.0)
        g_j = gl.convert_layout(g1, gl.SliceLayout(1, s_layout))
        g_i = gl.convert_layout(g1, gl.SliceLayout(0, s_layout))
        mbarrier.wait(ld_ready.index(s), (it // STAGES) & 1)
        s_acc = warpgroup_mma(k_s.index(s), q_s.index(s).permute((1, 0)),
                              gl.zeros([BT, BT], gl.float32, s_layout), use_acc=False,
                              is_async=True)
        s_acc = warpgroup_mma_wait(0, deps=[s_acc, k_s.index(s), q_s.index(s)])[0]
        causal = (ci[None, :] >= rj[:, None]) & (ci[None, :] < n)
        decay = gl.exp(gl.where(causal, g_i[None, :] - g_j[:, None], 0.0))
        p = gl.where(causal, s_acc * decay * scale, 0.0)
        p = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p, do_s.index(s), gl.zeros([BT, V], gl.float32, a_layout),
                            use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc, do_s.index(s)])[0]
        out = acc.to(dtype)
        b = it % DSTAGES
        mbarrier.wait(dvl_free.index(b), ((it // DSTAGES) & 1) ^ 1)
        dvl_s.index(b).store(out)
        gl.thread_barrier()  # every warp's store is done, and its MMAs on stage s
        mbarrier.arrive(dvl_ready.index(b), count=1)


@gluon.jit
def _state_partition(q_desc, k_desc, w_desc, do_desc, q_s, k_s, w_s, do_s, dvl_s, dh_s, dv_s,
                     ld_ready, dvl_ready, dvl_free, zero_bar, dv_desc, dh_desc, G, dht, dv, dh0,
                     doc_offsets, doc_chunk_offsets, i_n, i_hv, HV, tk, tw, tv, scale,
                     K: gl.constexpr,
                     V: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                     DSTAGES: gl.constexpr, USE_DHT: gl.constexpr, STORE: gl.constexpr):
    """S (default, 8 warps): the recurrence of :mod:`~gdn_core.ops.gluon.chunk_state_bwd`
    at ``BV = 128``, statement for statement, with ``dv_local`` from A's ring."""
    gl.static_assert(gl.num_warps() == 8)
    dtype: gl.constexpr = q_s.dtype
    BV: gl.constexpr = V
    L64: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BT, 16])
    L128: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, K, 16])
    A64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L64, k_width=2)
    A128: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L128, k_width=2)
    TOK: gl.constexpr = gl.SliceLayout(0, L64)
    # the loop's G gather: one value a thread, then into TOK (see _dvl_partition)
    G1: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                        warps_per_cta=[8], order=[0])
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1], order=[1, 0])

    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)
    c0 = gl.load(doc_chunk_offsets + i_n)

    # --- the first STAGES chunks' loads (chunk it = the document's chunk n_chunks-1-it)
    for j in gl.static_range(STAGES):
        if j < n_chunks:
            _issue_loads(q_desc, k_desc, w_desc, do_desc, ld_ready.index(j), q_s.index(j),
                         k_s.index(j), w_s.index(j), do_s.index(j),
                         bos + (n_chunks - 1 - j) * BT, tk, tw, tv)

    # --- dSᵀ from dht (or 0): rows = value columns, columns = keys
    rv = gl.arange(0, BV, layout=gl.SliceLayout(1, L128))
    ck = gl.arange(0, K, layout=gl.SliceLayout(0, L128))
    off_state = (i_n.to(gl.int64) * HV + i_hv) * (K * V)
    off_t = ck[None, :] * V + rv[:, None]
    if USE_DHT:
        ds = gl.load(dht + off_state + off_t).to(gl.float32)
    else:
        ds = gl.zeros([BV, K], gl.float32, L128)

    # --- the first chunk: zero a short chunk's foreign rows (before A reads them)
    tok = gl.arange(0, BT, layout=TOK)
    r1 = gl.arange(0, BT, layout=G1)
    rv64 = gl.arange(0, BV, layout=gl.SliceLayout(1, L64))
    L0 = gl.minimum(eos - (bos + (n_chunks - 1) * BT), BT)
    if n_chunks > 0:
        mbarrier.wait(ld_ready.index(0), 0)
        if L0 < BT:
            _zero_rows(q_s.index(0), L0, BT, K, IO)
            _zero_rows(k_s.index(0), L0, BT, K, IO)
            _zero_rows(w_s.index(0), L0, BT, K, IO)
            _zero_rows(do_s.index(0), L0, BT, BV, IO)
            fence_async_shared()
        gl.thread_barrier()
    mbarrier.arrive(zero_bar, count=1)
    t0 = bos + (n_chunks - 1) * BT
    p_g = G + (t0.to(gl.int64) * HV + i_hv)
    g = gl.load(p_g + tok * HV, mask=(tok < L0) & (n_chunks > 0), other=0.0)
    g_last = gl.load(p_g + (L0 - 1) * HV, mask=n_chunks > 0, other=0.0)
    dot = do_s.index(0).permute((1, 0)).load(L64).to(gl.float32)
    dos = gl.convert_layout((dot * gl.where(tok < L0, gl.exp(g) * scale, 0.0)[None, :]).to(dtype),
                            A128)

    for it in range(0, n_chunks):
        s = it % STAGES
        b = it % DSTAGES
        ic = n_chunks - 1 - it
        t0 = bos + ic * BT
        L = gl.minimum(eos - t0, BT)
        # ---- the chain: Xᵀ = dSᵀ Kᵀ, then the Q term behind it on the tensor cores
        dsb = ds.to(dtype)
        if STORE:
            dh_s.permute((1, 0)).store(dsb)  # dh[c] = dS_{c+1}
        xa = gl.convert_layout(dsb, A64)
        acc = ds * gl.exp(g_last)
        x = warpgroup_mma(xa, k_s.index(s).permute((1, 0)), gl.zeros([BV, BT], gl.float32, L64),
                          use_acc=False, is_async=True)
        acc = warpgroup_mma(dos, q_s.index(s), acc, is_async=True)
        # refill the previous chunk's stage with chunk it - 1 + STAGES, behind the MMAs
        if (it > 0) & (it - 1 + STAGES < n_chunks):
            sp = (it - 1) % STAGES
            _issue_loads(q_desc, k_desc, w_desc, do_desc, ld_ready.index(sp), q_s.index(sp),
                         k_s.index(sp), w_s.index(sp), do_s.index(sp),
                         t0 + (1 - STAGES) * BT, tk, tw, tv)
        # this chunk's dv_local from A (rows >= L selected to +0, the state kernel's value)
        mbarrier.wait(dvl_ready.index(b), (it // DSTAGES) & 1)
        x = warpgroup_mma_wait(1, deps=[x, k_s.index(s), xa])[0]
        kd = gl.where(tok < L, gl.exp(g_last - g), 0.0)
        dvlt = dvl_s.index(b).permute((1, 0)).load(L64).to(gl.float32)
        dvlt = gl.where((tok < L)[None, :], dvlt, 0.0)
        dvp = x * kd[None, :] + dvlt  # dV'ᵀ
        gl.thread_barrier()
        mbarrier.arrive(dvl_free.index(b), count=1)
        dva = gl.convert_layout((-dvp).to(dtype), A128)
        dvb = dvp.to(dtype)
        acc = warpgroup_mma_wait(0, deps=[acc, q_s.index(s), dos])[0]
        acc = warpgroup_mma(dva, w_s.index(s), acc, is_async=True)
        # next chunk's G (plain loads, while the W term runs)
        has_next = it + 1 < n_chunks
        p_g = G + ((t0 - BT).to(gl.int64) * HV + i_hv)
        g = gl.convert_layout(gl.load(p_g + r1 * HV, mask=(r1 < BT) & has_next, other=0.0), TOK)
        g_last = gl.load(p_g + (BT - 1) * HV, mask=has_next, other=0.0)
        # ---- off the chain: this chunk's stores, the next chunk's Q-term operand
        if STORE:
            if L < BT:
                p_dv = dv + (t0.to(gl.int64) * HV + i_hv) * V
                gl.store(p_dv + tok[None, :] * (HV * V) + rv64[:, None], dvb,
                         mask=(tok[None, :] < L) & (rv64[:, None] < BV))
            else:
                dv_s.permute((1, 0)).store(dvb)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dh_desc, [((c0 + ic) * HV + i_hv) * K, 0], dh_s)
            if L == BT:
                tma.async_copy_shared_to_global(dv_desc, [t0, tv], dv_s)
        sn = (it + 1) % STAGES
        mbarrier.wait(ld_ready.index(sn), ((it + 1) // STAGES) & 1, pred=has_next)
        dot = do_s.index(sn).permute((1, 0)).load(L64).to(gl.float32)
        dos = gl.convert_layout((dot * (gl.exp(g) * scale)[None, :]).to(dtype), A128)
        ds = warpgroup_mma_wait(0, deps=[acc, w_s.index(s), dva])[0]
        # ---- release stage s (and the staging tiles): the next iteration refills it with
        # chunk it + STAGES. A is done with it: its MMAs on stage s precede its dvl_ready
        # arrival for this chunk, waited above.
        if STORE:
            tma.store_wait(0)
        fence_async_shared()  # the generic reads of do_s[s] before the next TMA write
        gl.thread_barrier()

    # dh0 = dS_0 (offsets recomputed through an opaque zero, as the state kernel does)
    zero = gl.load(doc_offsets + i_n + 1) - eos
    off_e = (ck + zero)[None, :] * V + rv[:, None]
    gl.store(dh0 + off_state + off_e, ds)


@gluon.jit
def _fused_state_bwd_gluon_kernel(
    q_desc, k_desc, w_desc, do_desc, dv_desc, dh_desc,
    G, dht, dv, dh0, doc_offsets, doc_chunk_offsets, need, doc_order, scale, HV,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    STAGES: gl.constexpr, DSTAGES: gl.constexpr, USE_DHT: gl.constexpr,
    HAS_NEED: gl.constexpr, STORE: gl.constexpr, A_REGS: gl.constexpr,
    ORDERED: gl.constexpr = False,
):
    gl.static_assert(STAGES >= 2)
    gl.static_assert(DSTAGES >= 1)
    i_hv = gl.program_id(0)
    i_n = _doc_program(doc_order, ORDERED)
    i_h = i_hv // GROUP
    if HAS_NEED:
        if gl.load(need + i_n) == 0:
            return
    dtype: gl.constexpr = q_desc.dtype

    # --- shared memory: the TMA ring, the dv_local ring, the store staging tiles
    q_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], k_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], w_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [STAGES, BT, V], do_desc.layout)
    dvl_s = gl.allocate_shared_memory(dtype, [DSTAGES, BT, V], do_desc.layout)
    if STORE:
        dh_s = gl.allocate_shared_memory(dtype, [K, V], dh_desc.layout)
        dv_s = gl.allocate_shared_memory(dtype, [BT, V], dv_desc.layout)
    else:  # never touched: STORE is a constexpr of the state partition too
        dh_s = dvl_s
        dv_s = dvl_s
    ld_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dvl_ready = gl.allocate_shared_memory(gl.int64, [DSTAGES, 1], mbarrier.MBarrierLayout())
    dvl_free = gl.allocate_shared_memory(gl.int64, [DSTAGES, 1], mbarrier.MBarrierLayout())
    zero_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ld_ready.index(i), count=1)
    for i in gl.static_range(DSTAGES):
        mbarrier.init(dvl_ready.index(i), count=1)
        mbarrier.init(dvl_free.index(i), count=1)
    mbarrier.init(zero_bar, count=1)
    fence_async_shared()

    tk = i_h * K
    tw = i_hv * K
    tv = i_hv * V
    gl.warp_specialize([
        (_state_partition, (q_desc, k_desc, w_desc, do_desc, q_s, k_s, w_s, do_s, dvl_s, dh_s,
                            dv_s, ld_ready, dvl_ready, dvl_free, zero_bar, dv_desc, dh_desc, G,
                            dht, dv, dh0, doc_offsets, doc_chunk_offsets, i_n, i_hv, HV, tk, tw,
                            tv, scale, K, V, BT, STAGES, DSTAGES, USE_DHT, STORE)),
        (_dvl_partition, (q_s, k_s, do_s, dvl_s, ld_ready, dvl_ready, dvl_free, zero_bar, G,
                          doc_offsets, i_n, i_hv, HV, scale, BT, V, STAGES, DSTAGES)),
    ], [4], [A_REGS])


_FUSED_STATE_BWD_GLUON_KERNEL = cached_launch(_fused_state_bwd_gluon_kernel)


def gluon_fused_state_supported(q: torch.Tensor, W: torch.Tensor, do: torch.Tensor,
                                index: ChunkIndex) -> bool:
    """Whether :func:`fused_state_bwd_gluon` serves these shapes and dtypes (the device is
    not checked, nor the other tensors): K = V = 128, chunks of 64, q, W, do of one 16-bit
    dtype."""
    return (q.shape[-1] == _K and do.shape[-1] == _V and index.chunk_size == _BT
            and q.dtype in (torch.bfloat16, torch.float16)
            and W.dtype == q.dtype and do.dtype == q.dtype)


def _descriptors(q, k, W, do, dv, dh) -> dict:
    """TMA descriptors over the 2-D views the kernel tiles (CPU tensors suffice, for
    :mod:`tools.sm90_report`). ``dh``: ``[NT, HV, K, V]`` or any 16-bit tensor of ``K·V``
    elements a row group when nothing is stored."""
    K, V = q.shape[-1], do.shape[-1]
    return dict(
        q_desc=descriptor(q, [_BT, K]),
        k_desc=descriptor(k, [_BT, K]),
        w_desc=descriptor(W, [_BT, K]),
        do_desc=descriptor(do, [_BT, V]),
        dv_desc=descriptor(dv, [_BT, V]),
        dh_desc=descriptor(dh.reshape(-1, V), [K, V]),
    )


@launcher(uses_atomics=False, kernels=(_fused_state_bwd_gluon_kernel,))
def fused_state_bwd_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    G: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    scale: float,
    index: ChunkIndex,
    group: int,
    dh: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    *,
    store: bool = True,
    need: torch.Tensor | None = None,
    dh0: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``dv_local_bwd`` + ``chunk_state_bwd`` in one warp-specialised Gluon launch.

    The contract of :func:`gdn_core.ops.chunk_state_bwd.chunk_state_bwd` without its
    ``dv_local`` argument (computed inside): ``q, k: [T,H,128]``; ``W: [T,HV,128]``; ``G:
    [T,HV]`` fp32 (another float dtype is cast); ``do: [T,HV,128]``; ``dht:
    [N,HV,128,128]`` (any float dtype) or ``None``; ``q, k, W, do`` in one 16-bit dtype.
    ``dh``/``dv`` may supply the result buffers, ``dh0`` that of ``dh0`` (may be ``dht``).
    ``store=False``: only ``dh0``; ``need``: int32 ``[N]``, documents with ``need == 0``
    skipped (their ``dh0`` rows unwritten). The TMA ring has
    :data:`GLUON_FUSED_STATE_STAGES` stages, :data:`GLUON_FUSED_STATE_FIRST_PASS_STAGES`
    with ``store=False`` (read at each call; the bits do not depend on them).

    Returns:
        ``(dh [NT,HV,K,V], dv [T,HV,V])`` in q's dtype (``None, None`` when
        ``store=False``) and ``dh0 [N,HV,K,V]`` fp32; bitwise what ``dv_local_bwd`` then
        ``chunk_state_bwd`` return (by construction; checked on the GPU).

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks not of 64, the tiled
            tensors not of one 16-bit dtype, a ``need``/``dh``/``dv``/``dh0`` buffer of
            another shape or dtype (or not contiguous and 16-byte aligned), or more rows
            than TMA's int32 coordinates address, a ring depth the kernel cannot take
            (below 2, or above 2 with ``store``: the shared memory holds no more).
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    stages = GLUON_FUSED_STATE_STAGES if store else GLUON_FUSED_STATE_FIRST_PASS_STAGES
    if not 2 <= stages <= (2 if store else 3):
        raise ValueError(f"a ring of {stages} stages: the fused state backward takes 2 with "
                         "store=True (the staging tiles fill the rest of shared memory), "
                         "2 or 3 with store=False")
    outs, ready = prepare_state_bwd(q, k, W, G, do, None, dht, index, group, dh, dv,
                                    store=store, need=need, dh0=dh0,
                                    what="the Gluon fused state-backward kernel")
    if ready is None:
        return outs
    (dh, dv, dh0), (dht, G) = outs, ready
    K, V, dev = k.shape[2], do.shape[2], k.device
    HV, N = do.shape[1], index.num_docs
    # descriptors the kernel never uses (store=False) still need a 16-bit tensor
    dummy = None if store else torch.empty(K, V, dtype=q.dtype, device=dev)
    descs = _descriptors(q, k, W, do, dv if store else do, dh if store else dummy)
    order = ordered_docs(index)
    _FUSED_STATE_BWD_GLUON_KERNEL[(HV, N)](
        *descs.values(), G, dht if dht is not None else dh0, dv if store else dh0, dh0,
        index.doc_offsets, index.doc_chunk_offsets,
        need if need is not None else index.doc_chunk_offsets,
        index.doc_chunk_offsets if order is None else order, float(scale), HV,
        GROUP=group, K=K, V=V, BT=_BT, STAGES=stages,
        DSTAGES=GLUON_FUSED_STATE_DSTAGES, USE_DHT=dht is not None,
        HAS_NEED=need is not None, STORE=store, A_REGS=GLUON_FUSED_STATE_A_REGS,
        ORDERED=order is not None, num_warps=8, maxnreg=_MAXNREG,
    )
    return dh, dv, dh0
