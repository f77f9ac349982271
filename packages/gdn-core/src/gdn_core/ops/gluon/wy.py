"""Stage 2, the WY representation, in Gluon for Hopper (sm_90a): K = V = 128, 16-bit.

The forward kernel is a default stage (``wy`` in :data:`gdn_core.ops.gluon.DEFAULT_STAGES`,
session 20: 0.53x the Triton kernel's time as the det forward calls it, at B1 T32768 H16);
the apply kernel stays opt-in (slower than Triton's).

Two kernels: :func:`wy_fwd_gluon` (A, its inverse, W, U) and :func:`wy_apply_gluon` (the
backward's W, U from the stored inverse, no inversion; below, after the forward).

Same math, arguments and results as :func:`gdn_core.ops.wy.wy_fwd` (a drop-in)::

    A_ij  = β_i (k_i·k_j) exp(G_i − G_j)     i > j, i < n, else 0
    A_inv = (I + A)^{-1}                       unit lower triangular, fp32
    W     = A_inv · diag(β exp(G)) · K         [64, 128] in k's dtype
    U     = A_inv · diag(β) · V                [64, 128] in v's dtype

One CTA per (chunk, value head), one warpgroup (4 warps). Where the Triton kernel
(:func:`gdn_core.ops.wy._wy_kernel`) keeps its working ``A`` / ``A_inv`` in the
global ``A_inv`` slice and reads it back between CTA barriers, this kernel keeps
every intermediate in shared memory and writes ``A_inv`` once, at the end.

1. TMA loads of the chunk's K (``[64, 128]`` of the ``[T, H·K]`` view at ``(bos,
   head·K)``) and V (``[64, 128]`` of the ``[T, HV·V]`` view: a strided ``v`` whose head
   stride is ``V`` is read in place at its token stride) on two mbarriers, into
   NVMMA (128-byte swizzle) tiles.
2. ``K Kᵀ``: one ``warpgroup_mma`` (64×64, K = 128, Kᵀ a ``permute`` of K's tile),
   fp32 accumulator; ``A = where(i > j ∧ i < n, kk · exp(G_i − G_j) · β_i, 0)`` (the
   exponent masked before ``exp``), the Triton kernel's order, stored to an fp32 shared
   tile. Then K's and V's tiles are overwritten in place with the W/U operands
   ``diag(β e^G) K`` and ``diag(β) V`` (fp32 products rounded once to 16 bits, as the
   Triton kernel's 16-bit dot rounds them; rows ≥ n set to 0 by a select, so a
   non-finite row of the next document never reaches ``0 · NaN``).
3. The inverse, in fp32 FMA arithmetic (no tensor cores, no TF32), the Triton
   kernel's algorithm and order of products:

   * the four 16×16 diagonal blocks ``X_b = (I + a_b)^{-1}`` by substitution on
     their transposes, all four in one ``[4, 16, 16]`` register tile (block,
     column ``m`` of ``X_b``, entry ``c``): step ``i`` (1..15) sets entry ``i`` of every
     column to ``δ − Σ_c a_b[i, c] x[c]``, ``a_b``'s row ``i`` read from a shared
     ``[4, 16, 16]`` copy of the diagonal blocks and broadcast over the columns. A
     column lives in two threads (8 entries each): a sum is 8 in-thread FMAs and one
     shuffle; 15 dependent steps;
   * ``X_10 = −X_11 (A_10 X_00)``, ``X_32 = −X_33 (A_32 X_22)`` (16×16) and
     ``X_BL = −X_BR (A_BL X_TL)`` (32×32), each a pair of ``gl.dot_fma`` with
     operands loaded from the one shared tile, which holds ``A`` and takes ``X`` in
     place: the diagonal blocks ``X_b`` over ``a_b`` (copied out before), each merge's
     result over the ``A`` block it alone read, after a barrier; the upper blocks are
     ``A``'s zeros. The tile is swizzled (4-float groups XOR the row mod 8): unswizzled,
     the merges' operand loads put a column's rows in one bank, and the H200 profile
     (session 20) had the kernel bound by shared memory (87 % of L1's throughput);
     swizzled it took 0.233 against 0.327 ms at B1 T32768 H16.
4. ``A_inv`` stored from ``X``: fp32 (rows < n, 16-byte stores), or (with
   ``A_inv_for_backward``) rounded to 16 bits by the kernel — a TMA store of the rounded
   tile for a full chunk, masked rows for a short one: the fp32 one's bits rounded, with no
   fp32 copy and no cast launch; then rounded to 16 bits into an NVMMA tile, and
   ``W = A_inv16 · Y_K``, then ``U = A_inv16 · Y_V``
   (:func:`_wu_products`: one ``warpgroup_mma`` each, 64×128, K = 64, both operands in
   shared memory; one accumulator live at a time), each rounded into its operand's
   spent tile and stored from there: a TMA store of the whole tile for a full chunk,
   16-byte masked stores of rows < n for a short one (:func:`_store_rows`).

Rows ≥ n (the last chunk of a document): TMA reads whole 64-row tiles, so K's and
V's rows ≥ n hold the next document's rows (zeros past ``T``). They reach only
``kk``'s rows/columns ≥ n, which the mask of ``A`` selects away, and the W/U
operands, where they are selected to 0. ``A``'s rows ≥ n are zero, so ``X``'s rows ≥ n
are identity rows (the Triton kernel reads them as zero rows instead); a row
``i < n`` of ``X`` depends on rows ``≤ i`` only, so the rows that are stored are the
same either way. Nothing is stored past row ``n``; ``A_inv``'s columns ≥ n are exact
zeros (upper triangle).

Determinism: no atomics, every sum in a fixed order (one CTA owns each output
tile; the substitution, the FMA dots and the wgmma K loops are fixed), so two calls
give the same bits. Not bitwise equal to the Triton kernel (other reduction
orders in the substitution and the FMA dots), and so :func:`gdn_core.ops.wy.wy_apply`
from this kernel's ``A_inv`` gives W, U within rounding of, not equal to, this
kernel's.

Shared memory (53,520 B; 163 registers × 128 threads fit three CTAs per SM, the shared
memory four; a cap of 128 registers spills 72 B and was not faster on the H200): K and V
tiles (16 KiB each, reused for the W/U operands), ``A`` / ``X`` fp32 (16 KiB; it takes the
16-bit ``A_inv`` once the merges are done, a ``_reinterpret`` as an NVMMA tile: it sits at
a 1024-byte aligned offset, 32,768, as the 128-byte swizzle needs), the diagonal blocks
(4 KiB: ``a_b``, then ``X_b``), barriers. Session 13's version kept ``X`` in a second
tile (69,904 B) and always wrote the fp32 inverse (cast to 16 bits by another launch).

Compiled for sm_90a with Triton 3.6 (``PYTHONPATH=/tmp/t36:packages/gdn-core/src python
tools/sm90_report.py gluon_wy``, bf16, group 1 and 2 alike)::

    warps=4 (the launcher's): 163 registers, 0 spills, 53,520 B shared, 3,048 SASS
    warps=4, MERGE_K=16:      106 registers, 0 spills, 53,520 B shared, 3,048 SASS
                              (the 32x32 merge's dots in two slices each: four CTAs an SM)

against the Triton ``_wy_kernel`` (inverting, 8 warps): 100 registers, 0 spills,
16,384 B shared, 1,776 SASS instructions. The PTX has 16 ``wgmma.mma_async`` (K Kᵀ
and the two A_inv products), 745 ``fma.rn.f32``, 37 ``bar.sync``.

The apply kernel (:func:`wy_apply_gluon`; same arguments and results as
:func:`gdn_core.ops.wy.wy_apply`), one CTA per (chunk, value head), one warpgroup: the
three TMA loads issued first (K at ``(bos, head·K)`` of ``[T, H·K]``, V of ``[T, HV·V]``,
the 16-bit ``A_inv`` at ``(bos, hv·64)`` of ``[T, HV·64]``: ``inverse_for_backward``'s
copy read in place; an fp32 one is rounded to 16 bits on the host, the rounding the
Triton kernel applies before its 16-bit dot), β and G (rows ≥ n read 0) while they fly;
then the forward's own code for the rest: the W/U operands in place in K's and V's tiles
(:func:`_scale_rows`: rows ≥ n, the next document's or TMA's zeros past ``T``, selected
to 0 before any product, so a NaN there cannot reach ``0 · NaN``) and the two products
and stores (:func:`_wu_products`). ``A_inv``'s rows ≥ n (the next chunk's) are not
zeroed: row ``i`` of a product reads row ``i`` of ``A_inv`` only, and rows ≥ n are
never stored. Memory-bound (K, V, A_inv read; W, U written): 40,984 B of shared memory
and 102 registers × 128 threads, so four CTAs per SM (160 KiB of loads in flight per
SM). Compiled, not yet run (``tools/sm90_report.py gluon_wy_apply``, bf16, group 1 and 2
alike)::

    warps=4 (the launcher's):  102 registers, 0 spills, 40,984 B shared, 1,144 SASS
    warps=4, maxnreg=96:        96 registers, 0 spills (five CTAs per SM; a probe option)
    warps=8:                    62 registers, 0 spills, 40,984 B shared,   696 SASS

against the Triton ``_wy_kernel`` non-inverting on the bf16 ``A_inv`` (8 warps): 48
registers, 0 spills, 16,384 B shared, 392 SASS. With both products in flight at once
(the accumulators live together) the apply kernel took 154 registers (three CTAs per
SM): hence one at a time.
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex
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

__all__ = ["GLUON_WY_APPLY_WARPS", "GLUON_WY_WARPS", "check_wy_inputs",
           "gluon_wy_apply_supported",
           "gluon_wy_supported", "wy_apply_gluon", "wy_fwd_gluon"]


#: Warps of the kernel (one warpgroup; 8 = two warpgroups splitting the wgmma columns,
#: the inverse replicated in both).
GLUON_WY_WARPS = 4
#: ptxas register cap of the forward kernel (None: ptxas's choice)
GLUON_WY_MAXNREG: int | None = None
#: Depth of the contraction slices of the 32x32 merge's two FMA dots: 32 (one dot each,
#: the operands whole in registers: 163 registers, three CTAs an SM) or 16 (two chained
#: dots each, the product T through A_BL's block: 106 registers, no spills, four CTAs an SM
#: by both registers and shared memory; ``gl.dot_fma`` takes K >= 16). The FMA chains are
#: the same either way (so the bits: the GPU test checks it on the H200). 16 is the default:
#: 0.219 against 0.244 ms at B1 T32768 H16 8 documents (``gluon_wy_probe.py --merge-k
#: 32,16``, session 21, ``benchmarks/results/2026-12-04-h200-s21.md``).
GLUON_WY_MERGE_K = 16
#: Warps of the apply kernel (one warpgroup; 8 = two, each taking 64 of the 128 columns).
GLUON_WY_APPLY_WARPS = 4
#: ptxas register cap of the apply kernel (None: ptxas's choice, 102 at 4 warps, four CTAs
#: per SM; 96 compiles without spills and fits five, as shared memory does: a probe option).
GLUON_WY_APPLY_MAXNREG: int | None = None
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _fma_pair(a_l, b_l, x2_s, z, op_a: gl.constexpr, op_b: gl.constexpr):
    """``−X2 (A X)``: ``a_l``/``b_l`` the shared ``A``/``X`` sub-tiles of the inner
    product, ``x2_s`` the outer ``X``; fp32 FMA dots (``z``: a zero accumulator)."""
    t = gl.dot_fma(a_l.load(op_a), b_l.load(op_b), z)
    return -gl.dot_fma(x2_s.load(op_a), gl.convert_layout(t, op_b), z)


@gluon.jit
def _scale_rows(x_s, s, n, IO: gl.constexpr):
    """The W/U operand in place: ``x_s`` (a ``[64, D]`` 16-bit tile as TMA read it) ←
    ``diag(s) x_s``, the fp32 product rounded once to 16 bits (as the Triton kernel's
    16-bit dot rounds it); rows ≥ ``n`` (the next document's, or TMA's zeros past ``T``)
    set to 0 by a select, so a non-finite row there never reaches ``0 · NaN``.
    ``s``: ``[64]`` fp32 (any layout; 0 past ``n``)."""
    BT: gl.constexpr = x_s.shape[0]
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, IO))
    x = x_s.load(IO).to(gl.float32) * gl.convert_layout(s, gl.SliceLayout(1, IO))[:, None]
    x_s.store(gl.where((r < n)[:, None], x, 0.0).to(x_s.dtype))


@gluon.jit
def _store_rows(acc, o_s, o_desc, O, bos, col, n, RS, IO: gl.constexpr):
    """Store the ``[64, D]`` fp32 product ``acc`` (rounded to ``O``'s 16-bit type) at rows
    ``bos + [0, n)``, columns ``col + [0, D)`` of the ``[T, RS]`` output ``O``, through
    ``o_s`` (its operand tile, spent: the caller has waited for the product): a TMA store
    of the whole tile when ``n = 64``, else 16-byte masked stores of rows < n from the
    tile (the rows past ``n`` are the next chunk's, another CTA's). The caller waits for
    the TMA store (``tma.store_wait``) before the CTA exits."""
    BT: gl.constexpr = o_s.shape[0]
    D: gl.constexpr = o_s.shape[1]
    gl.thread_barrier()  # every warpgroup's product has read o_s
    o_s.store(acc.to(o_s.dtype))
    fence_async_shared()
    gl.thread_barrier()
    if n == BT:
        tma.async_copy_shared_to_global(o_desc, [bos, col], o_s)
    else:
        r = gl.arange(0, BT, layout=gl.SliceLayout(1, IO))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, IO))
        offs = (bos + r).to(gl.int64)[:, None] * RS + (col + c)[None, :]
        gl.store(O + offs, o_s.load(IO), mask=(r < n)[:, None] & (c < D)[None, :])


@gluon.jit
def _wu_products(a_s, k_s, v_s, w_desc, u_desc, W, U, bos, i_hv, HV, n, K: gl.constexpr,
                 V: gl.constexpr, IO: gl.constexpr, L: gl.constexpr):
    """``W = A_inv · Y_K`` and ``U = A_inv · Y_V`` of one chunk and their stores (rows < n):
    ``a_s`` the ``[64, 64]`` 16-bit ``A_inv`` (NVMMA), ``k_s``/``v_s`` the W/U operands
    (:func:`_scale_rows`, fenced); two asynchronous ``warpgroup_mma`` (64×128, K = 64,
    fp32 accumulators in layout ``L``), then each result through its operand's tile
    (:func:`_store_rows`); returns once the TMA stores have read the tiles."""
    BT: gl.constexpr = a_s.shape[0]
    w = warpgroup_mma(a_s, k_s, gl.zeros([BT, K], gl.float32, L), use_acc=False,
                      is_async=True)
    w = warpgroup_mma_wait(0, deps=[w, a_s, k_s])[0]
    _store_rows(w, k_s, w_desc, W, bos, i_hv * K, n, HV * K, IO)
    u = warpgroup_mma(a_s, v_s, gl.zeros([BT, V], gl.float32, L), use_acc=False,
                      is_async=True)
    u = warpgroup_mma_wait(0, deps=[u, a_s, v_s])[0]
    _store_rows(u, v_s, u_desc, U, bos, i_hv * V, n, HV * V, IO)
    tma.store_wait(0)


@gluon.jit
def _wy_fwd_gluon_kernel(
    k_desc,
    v_desc,
    w_desc,
    u_desc,
    a_desc,
    beta,
    G,
    A_inv,
    W,
    U,
    chunk_start,
    chunk_len,
    HV,
    GROUP: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    STORE_A: gl.constexpr,
    MERGE_K: gl.constexpr = 32,
    STORE_WU: gl.constexpr = True,
):
    gl.static_assert(BT == 64)
    gl.static_assert(K == V)
    gl.static_assert((MERGE_K == 16) or (MERGE_K == 32))
    i_c = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_h = i_hv // GROUP
    bos = gl.load(chunk_start + i_c)
    n = gl.load(chunk_len + i_c)
    dtype: gl.constexpr = k_desc.dtype
    NW: gl.constexpr = gl.num_warps()
    WG: gl.constexpr = NW // 4

    # --- register layouts
    L64: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BT // WG, 16])
    L128: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, V // WG, 16])
    R64: gl.constexpr = gl.SliceLayout(1, L64)
    C64: gl.constexpr = gl.SliceLayout(0, L64)
    IO: gl.constexpr = gl.BlockedLayout(  # [64, 128] 16-bit: 16-byte accesses
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[NW, 1], order=[1, 0])
    IOF: gl.constexpr = gl.BlockedLayout(  # [64, 64] fp32: 16-byte accesses
        size_per_thread=[1, 4], threads_per_warp=[2, 16], warps_per_cta=[NW, 1], order=[1, 0])
    # substitution tile [block, column m, entry c]: a column in 2 threads of 8 entries
    L3: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 8], threads_per_warp=[1, 16, 2], warps_per_cta=[4, WG, 1],
        order=[2, 1, 0])
    # FMA dots: 16x16 and 32x32 fp32 accumulators
    M16: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 2], threads_per_warp=[16, 2], warps_per_cta=[1, NW], order=[1, 0])
    M32: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[2, 4], threads_per_warp=[16, 2], warps_per_cta=[1, NW], order=[1, 0])
    A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M16, k_width=0)
    B16: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=M16, k_width=0)
    A32: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M32, k_width=0)
    B32: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=M32, k_width=0)
    FP2: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    FP3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                order=[2, 1, 0])

    # --- shared memory (53 KB; the registers allow three CTAs an SM)
    k_s = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)  # K, then diag(βe^G) K
    v_s = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)  # V, then diag(β) V
    # A, inverted in place into X = A_inv; then the 16-bit A_inv (the W/U products' operand)
    a_s = gl.allocate_shared_memory(gl.float32, [BT, BT], FP2)
    # the diagonal blocks a_b (2-D blocks through a [64, 16] view)
    d_s = gl.allocate_shared_memory(gl.float32, [4, 16, 16], FP3)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(bars.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [bos, i_h * K], bars.index(0), k_s)
    if STORE_WU:  # V serves U alone
        mbarrier.expect(bars.index(1), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [bos, i_hv * V], bars.index(1), v_s)

    # --- G, β of the chunk (rows >= n read 0), while K flies
    rows = gl.arange(0, BT, layout=R64)
    cols = gl.arange(0, BT, layout=C64)
    p_s = bos.to(gl.int64) * HV + i_hv
    g_r = gl.load(G + p_s + rows * HV, mask=rows < n, other=0.0).to(gl.float32)
    g_c = gl.load(G + p_s + cols * HV, mask=cols < n, other=0.0).to(gl.float32)
    b_r = gl.load(beta + p_s + rows * HV, mask=rows < n, other=0.0).to(gl.float32)

    # --- A = strict-lower(β_i exp(G_i − G_j) k_i·k_j), rows < n (zeros on and above the
    # diagonal: the upper blocks of X, which the merges read, are these zeros)
    mbarrier.wait(bars.index(0), 0)
    kk = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, L64),
                       use_acc=False)
    m = (rows[:, None] > cols[None, :]) & (rows[:, None] < n)
    e = gl.exp(gl.where(m, g_r[:, None] - g_c[None, :], 0.0))
    a_s.store(gl.where(m, kk * e * b_r[:, None], 0.0))
    gl.thread_barrier()  # A in shared memory; every warp is done reading K for K Kᵀ

    # --- the diagonal blocks a_b into d_s; the W/U operands over K's and V's tiles
    for b in gl.static_range(4):
        d_s.reshape([64, 16]).slice(16 * b, 16, 0).store(
            a_s.slice(16 * b, 16, 0).slice(16 * b, 16, 1).load(M16))
    if STORE_WU:
        _scale_rows(k_s, b_r * gl.exp(g_r), n, IO)
        mbarrier.wait(bars.index(1), 0)
        _scale_rows(v_s, b_r, n, IO)
    gl.thread_barrier()

    # --- X_b = (I + a_b)^{-1}, transposed, the four blocks together: 15 dependent steps
    bm = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    bc = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    m3 = bm[None, :, None]
    c3 = bc[None, None, :]
    xt = gl.where(m3 == c3, 1.0, 0.0) + gl.zeros([4, 16, 16], gl.float32, L3)
    for i in gl.static_range(1, 16):
        a_i = d_s.slice(i, 1, 1).load(L3)  # [4, 1, 16]: row i of every a_b
        s = gl.sum(xt * a_i, axis=2)
        xt = gl.where(c3 == i, xt - s[:, :, None], xt)
    gl.thread_barrier()  # every step's read of a_b is done: the tile takes X_b
    d_s.store(gl.permute(xt, (0, 2, 1)))  # X_b, rows c, columns m
    gl.thread_barrier()
    for b in gl.static_range(4):  # over A's diagonal blocks (a_b was copied out above)
        a_s.slice(16 * b, 16, 0).slice(16 * b, 16, 1).store(
            d_s.reshape([64, 16]).slice(16 * b, 16, 0).load(M16))
    gl.thread_barrier()

    # --- X_10 = −X_11 (A_10 X_00), X_32 = −X_33 (A_32 X_22): each over its A_10 once
    # every read of both is done
    z16 = gl.zeros([16, 16], gl.float32, M16)
    x10 = _fma_pair(a_s.slice(16, 16, 0).slice(0, 16, 1), a_s.slice(0, 16, 0).slice(0, 16, 1),
                    a_s.slice(16, 16, 0).slice(16, 16, 1), z16, A16, B16)
    x32 = _fma_pair(a_s.slice(48, 16, 0).slice(32, 16, 1), a_s.slice(32, 16, 0).slice(32, 16, 1),
                    a_s.slice(48, 16, 0).slice(48, 16, 1), z16, A16, B16)
    gl.thread_barrier()
    a_s.slice(16, 16, 0).slice(0, 16, 1).store(x10)
    a_s.slice(48, 16, 0).slice(32, 16, 1).store(x32)
    gl.thread_barrier()

    # --- X_BL = −X_BR (A_BL X_TL), over A_BL
    z32 = gl.zeros([32, 32], gl.float32, M32)
    bl = a_s.slice(32, 32, 0).slice(0, 32, 1)
    if MERGE_K == 32:  # both products as one FMA dot each (operands whole in registers)
        x_bl = _fma_pair(bl, a_s.slice(0, 32, 0).slice(0, 32, 1),
                         a_s.slice(32, 32, 0).slice(32, 32, 1), z32, A32, B32)
    else:  # in MERGE_K-deep slices of the contraction: the same FMA chains, fewer registers
        t = z32
        for kc in gl.static_range(0, 32, MERGE_K):
            t = gl.dot_fma(bl.slice(kc, MERGE_K, 1).load(A32),
                           a_s.slice(kc, MERGE_K, 0).slice(0, 32, 1).load(B32), t)
        gl.thread_barrier()  # every read of A_BL is done: its block holds T = A_BL X_TL
        bl.store(t)
        gl.thread_barrier()
        x_bl = z32
        for kc in gl.static_range(0, 32, MERGE_K):
            x_bl = gl.dot_fma(a_s.slice(32, 32, 0).slice(32 + kc, MERGE_K, 1).load(A32),
                              bl.slice(kc, MERGE_K, 0).load(B32), x_bl)
        x_bl = -x_bl
    gl.thread_barrier()
    bl.store(x_bl)
    gl.thread_barrier()

    # --- A_inv: fp32 (STORE_A == 32, rows < n) or rounded to the input type (STORE_A ==
    # 16, the copy the backward reads); either way its 16-bit copy for the W/U products
    x = a_s.load(IOF)
    ar = gl.arange(0, BT, layout=gl.SliceLayout(1, IOF))
    ac = gl.arange(0, BT, layout=gl.SliceLayout(0, IOF))
    a_offs = p_s * BT + ar[:, None] * (HV * BT) + ac[None, :]
    a_rows = (ar[:, None] < n) & (ac[None, :] < BT)
    if STORE_A == 32:
        gl.store(A_inv + a_offs, x, mask=a_rows)
    gl.thread_barrier()  # every read of X is done: its tile takes the 16-bit A_inv
    # (A's tile sits at a 1024-byte aligned offset, 32,768, as the 128-byte swizzle needs)
    x16_s = a_s._reinterpret(dtype, [BT, BT],
                             gl.NVMMASharedLayout.get_default_for([BT, BT], dtype))
    x16 = x.to(dtype)
    x16_s.store(x16)
    fence_async_shared()
    gl.thread_barrier()
    if STORE_A == 16:
        if n == BT:
            tma.async_copy_shared_to_global(a_desc, [bos, i_hv * BT], x16_s)
        else:
            gl.store(A_inv + a_offs, x16, mask=a_rows)

    # --- W = A_inv diag(βe^G) K, U = A_inv diag(β) V (waits for every TMA store)
    if STORE_WU:
        _wu_products(x16_s, k_s, v_s, w_desc, u_desc, W, U, bos, i_hv, HV, n, K, V, IO, L128)
    else:  # the inverse alone (its consumer forms W and U itself)
        tma.store_wait(0)
    for i in gl.static_range(2):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _wy_apply_gluon_kernel(
    k_desc,
    v_desc,
    w_desc,
    u_desc,
    a_desc,
    beta,
    G,
    W,
    U,
    chunk_start,
    chunk_len,
    HV,
    GROUP: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
):
    """``W, U`` of one (chunk, value head) from the stored 16-bit ``A_inv`` (no inversion):
    the three TMA loads up front, the W/U operands in place, the two products and stores
    shared with :func:`_wy_fwd_gluon_kernel` (:func:`_scale_rows`, :func:`_wu_products`)."""
    gl.static_assert(BT == 64)
    i_c = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_h = i_hv // GROUP
    bos = gl.load(chunk_start + i_c)
    n = gl.load(chunk_len + i_c)
    dtype: gl.constexpr = k_desc.dtype
    NW: gl.constexpr = gl.num_warps()
    WG: gl.constexpr = NW // 4
    L128: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, V // WG, 16])
    IO: gl.constexpr = gl.BlockedLayout(  # [64, 128] 16-bit: 16-byte accesses
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[NW, 1], order=[1, 0])

    k_s = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)  # K, diag(βe^G) K, then W
    v_s = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)  # V, diag(β) V, then U
    a_s = gl.allocate_shared_memory(dtype, [BT, BT], a_desc.layout)  # A_inv (16-bit)
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    # --- every load up front: K, V (the order of use), A_inv
    mbarrier.expect(bars.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [bos, i_h * K], bars.index(0), k_s)
    mbarrier.expect(bars.index(1), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [bos, i_hv * V], bars.index(1), v_s)
    mbarrier.expect(bars.index(2), a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [bos, i_hv * BT], bars.index(2), a_s)

    # --- G, β of the chunk (rows >= n read 0), in the operand tiles' row layout
    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, IO))
    p_s = bos.to(gl.int64) * HV + i_hv
    g = gl.load(G + p_s + rows * HV, mask=rows < n, other=0.0).to(gl.float32)
    b = gl.load(beta + p_s + rows * HV, mask=rows < n, other=0.0).to(gl.float32)

    # --- the W/U operands over K's and V's tiles (rows >= n selected to 0)
    mbarrier.wait(bars.index(0), 0)
    _scale_rows(k_s, b * gl.exp(g), n, IO)
    mbarrier.wait(bars.index(1), 0)
    _scale_rows(v_s, b, n, IO)
    fence_async_shared()
    gl.thread_barrier()

    # --- W = A_inv diag(βe^G) K, U = A_inv diag(β) V
    mbarrier.wait(bars.index(2), 0)
    _wu_products(a_s, k_s, v_s, w_desc, u_desc, W, U, bos, i_hv, HV, n, K, V, IO, L128)
    for i in gl.static_range(3):
        mbarrier.invalidate(bars.index(i))


_WY_APPLY_GLUON_KERNEL = cached_launch(_wy_apply_gluon_kernel)
_WY_FWD_GLUON_KERNEL = cached_launch(_wy_fwd_gluon_kernel)


def gluon_wy_supported(k: torch.Tensor, v: torch.Tensor, index: ChunkIndex) -> bool:
    """Whether :func:`wy_fwd_gluon` serves these shapes and dtypes (the device is not
    checked, nor beta/G): K = V = 128, chunks of 64, k and v of one 16-bit dtype, and the
    register inverse not asked for (``GDN_CORE_WY_INV=reg`` is a variant of the Triton
    kernel: asking for it keeps the Triton WY).

    Raises:
        ValueError: ``GDN_CORE_WY_INV`` names no known inverse.
    """
    from gdn_core.ops.wy import wy_inverse_choice

    return (k.shape[-1] == _K and v.shape[-1] == _V and index.chunk_size == _BT
            and k.dtype in (torch.bfloat16, torch.float16) and v.dtype == k.dtype
            and wy_inverse_choice() != "reg")


def gluon_wy_apply_supported(k: torch.Tensor, v: torch.Tensor, A_inv: torch.Tensor,
                             index: ChunkIndex) -> bool:
    """Whether :func:`wy_apply_gluon` serves these shapes and dtypes (the device is not
    checked, nor beta/G): what :func:`gluon_wy_supported` serves, with ``A_inv`` in k's
    16-bit dtype (:func:`~gdn_core.ops.wy.inverse_for_backward`'s copy, the backward's)
    or fp32 (rounded to k's dtype on the host, as the Triton kernel rounds it)."""
    return gluon_wy_supported(k, v, index) and A_inv.dtype in (k.dtype, torch.float32)


def _require_gluon_sm90(device: torch.device) -> None:
    require_sm90(device, "the Gluon WY kernel")


def check_wy_inputs(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, G: torch.Tensor,
                  index: ChunkIndex, group: int) -> None:
    """The input checks of the Gluon kernels that form ``W`` and ``U`` (the WY forward,
    its apply, :mod:`gdn_core.ops.gluon.recompute`): ``ValueError`` for shapes that do not
    match, K or V not 128, chunks not of 64, k and v not of one 16-bit dtype, or more rows
    than TMA's int32 coordinates address."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    if (v.shape[0] != T or HV != H * group or tuple(beta.shape) != (T, HV)
            or tuple(G.shape) != (T, HV) or T != index.total_tokens):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}, "
            f"G {tuple(G.shape)}, group {group}, tokens {index.total_tokens}")
    if (K, V) != (_K, _V) or index.chunk_size != _BT:
        raise ValueError(f"the Gluon W/U kernels serve K = V = {_K} and chunks of {_BT}, got "
                         f"K={K}, V={V}, chunk size {index.chunk_size}")
    if k.dtype not in (torch.bfloat16, torch.float16) or v.dtype != k.dtype:
        raise ValueError(f"the Gluon W/U kernels take k and v in one 16-bit dtype, got "
                         f"{k.dtype}, {v.dtype}")
    if T >= 2**31:
        raise ValueError(f"T={T} exceeds TMA's int32 coordinates")


def _descriptors(k: torch.Tensor, v: torch.Tensor, W: torch.Tensor, U: torch.Tensor) -> dict:
    """TMA descriptors of both kernels' ``[64, 128]`` tiles: K of the ``[T, H·K]`` view, V
    of ``[T, HV·V]`` (a packed-head view in place, :func:`~gdn_core.ops.gluon.tma.rows_view`),
    and the outputs W, U (``[T, HV·128]``, contiguous: TMA stores of whole chunks)."""
    return dict(k_desc=descriptor(k, [_BT, _K]),
                v_desc=descriptor(v, [_BT, _V]),
                w_desc=descriptor(W, [_BT, _K]),
                u_desc=descriptor(U, [_BT, _V]))


def _small_inputs(beta: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``beta`` contiguous (any float dtype, read as fp32) and ``G`` contiguous fp32."""
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    return beta.contiguous(), G


@launcher(uses_atomics=False, kernels=(_wy_fwd_gluon_kernel,))
def wy_fwd_gluon(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    index: ChunkIndex,
    group: int,
    *,
    output_A_inv: bool = True,
    A_inv_for_backward: bool = False,
    output_WU: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """WY representation of every chunk, by the Gluon kernel (a default stage since session
    20; the Triton :func:`gdn_core.ops.wy.wy_fwd` takes the same arguments and returns the
    same results, within rounding: other bits).

    Args:
        k: ``[T, H, 128]`` bf16 or fp16 keys; head ``hv // group`` serves value head ``hv``.
        v: ``[T, HV, 128]`` in k's dtype, ``HV = H * group`` (read in place at its token
            stride when its heads are packed, unit last stride, 16-byte aligned rows).
        beta: ``[T, HV]`` write strengths (any float dtype).
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (another float dtype is cast).
        index: the chunk table (chunks of 64 tokens).
        group: value heads per key head.
        output_A_inv: also return ``A_inv`` (when False the kernel does not write it).
        A_inv_for_backward: return ``A_inv`` as the backward reads it
            (:func:`~gdn_core.ops.wy.inverse_for_backward`): rounded to k's dtype in the
            kernel, which then writes no fp32 copy.
        output_WU: also form and return ``W`` and ``U`` (when False the kernel neither
            reads ``v`` nor writes them: for a consumer that forms them from the 16-bit
            inverse itself, :mod:`~gdn_core.ops.gluon.fused_fwd_formed`).

    Returns:
        ``(A_inv, W, U)``: ``A_inv: [T, HV, 64]`` fp32 (row ``t`` = row of ``(I + A)^{-1}``
        of its chunk, columns within the chunk, zero past the chunk's length; with
        ``A_inv_for_backward`` in k's dtype) or ``None``; ``W: [T, HV, 128]`` in k's
        dtype and ``U: [T, HV, 128]`` in v's dtype, or both ``None`` (``output_WU``).

    Raises:
        ValueError: shapes that do not match (as :func:`~gdn_core.ops.wy.wy_fwd`), K or V
            not 128, chunks not of 64, k and v not of one 16-bit dtype, or more rows than
            TMA's int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    check_wy_inputs(k, v, beta, G, index, group)
    _require_gluon_sm90(k.device)
    T, HV = k.shape[0], v.shape[1]
    dev = k.device
    W = U = None
    if output_WU:
        W = torch.empty(T, HV, _K, dtype=k.dtype, device=dev)
        U = torch.empty(T, HV, _V, dtype=v.dtype, device=dev)
    store = 0 if not output_A_inv else (16 if A_inv_for_backward else 32)
    A_inv = torch.empty(T if store else 0, HV, _BT, device=dev,
                        dtype=k.dtype if store == 16 else torch.float32)
    if index.num_chunks == 0 or HV == 0 or T == 0:
        return (A_inv if output_A_inv else None), W, U
    beta, G = _small_inputs(beta, G)
    # without W and U their descriptors and pointers are unused stand-ins (k's)
    descs = _descriptors(k, v, k if W is None else W, k if U is None else U)
    # the 16-bit inverse's TMA store (full chunks); otherwise an unused stand-in
    a_desc = (descriptor(A_inv, [_BT, _BT]) if store == 16 else descs["w_desc"])
    # runtime arguments positionally, as cached_launch's fast path takes them (one by
    # keyword sends every call through Triton's argument binding)
    _WY_FWD_GLUON_KERNEL[(index.num_chunks, HV)](
        descs["k_desc"], descs["v_desc"], descs["w_desc"], descs["u_desc"], a_desc, beta, G,
        A_inv, k if W is None else W, k if U is None else U, index.chunk_start,
        index.chunk_len, HV, GROUP=group, K=_K, V=_V, BT=_BT, STORE_A=store,
        MERGE_K=GLUON_WY_MERGE_K, STORE_WU=output_WU, num_warps=GLUON_WY_WARPS,
        maxnreg=GLUON_WY_MAXNREG,
    )
    return (A_inv if output_A_inv else None), W, U


@launcher(uses_atomics=False, kernels=(_wy_apply_gluon_kernel,))
def wy_apply_gluon(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    A_inv: torch.Tensor,
    index: ChunkIndex,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W, U`` of every chunk from a stored ``A_inv``, by the Gluon kernel (opt-in; the
    Triton :func:`gdn_core.ops.wy.wy_apply` is the default, with the same arguments and
    results; the backward's recompute).

    Args:
        k, v, beta, G, index, group: as :func:`wy_fwd_gluon` (``k``/``v`` 16-bit, K = V =
            128, chunks of 64).
        A_inv: ``[T, HV, 64]`` the chunks' inverses (:func:`wy_fwd_gluon`'s or
            :func:`~gdn_core.ops.wy.wy_fwd`'s), in k's dtype
            (:func:`~gdn_core.ops.wy.inverse_for_backward`, the backward's, read in place
            through TMA) or fp32 (rounded to k's dtype first, as the Triton kernel rounds
            it before its 16-bit dot: the same operand bits). Rows past a chunk's length
            are not read into any stored row; columns past it must be 0 (they are, in
            either forward's inverse).

    Returns:
        ``(W, U)``: ``W: [T, HV, 128]`` in k's dtype, ``U: [T, HV, 128]`` in v's dtype;
        within rounding of, not bitwise equal to, :func:`~gdn_core.ops.wy.wy_apply`'s
        (other accumulation orders in the tensor-core products), deterministic.

    Raises:
        ValueError: what :func:`wy_fwd_gluon` raises, or ``A_inv`` not ``[T, HV, 64]`` in
            k's dtype or fp32.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    T, HV = k.shape[0], v.shape[1]
    if tuple(A_inv.shape) != (T, HV, _BT) or A_inv.dtype not in (k.dtype, torch.float32):
        raise ValueError(f"A_inv must be [T, HV, {_BT}] = {(T, HV, _BT)} in {k.dtype} or "
                         f"torch.float32, got {tuple(A_inv.shape)} {A_inv.dtype}")
    check_wy_inputs(k, v, beta, G, index, group)
    _require_gluon_sm90(k.device)
    dev = k.device
    W = torch.empty(T, HV, _K, dtype=k.dtype, device=dev)
    U = torch.empty(T, HV, _V, dtype=v.dtype, device=dev)
    if index.num_chunks == 0 or HV == 0 or T == 0:
        return W, U
    beta, G = _small_inputs(beta, G)
    if A_inv.dtype != k.dtype:
        A_inv = A_inv.to(k.dtype)
    _WY_APPLY_GLUON_KERNEL[(index.num_chunks, HV)](
        *_descriptors(k, v, W, U).values(), descriptor(A_inv, [_BT, _BT]), beta,
        G, W, U, index.chunk_start, index.chunk_len, HV, GROUP=group, K=_K, V=_V, BT=_BT,
        num_warps=GLUON_WY_APPLY_WARPS, maxnreg=GLUON_WY_APPLY_MAXNREG,
    )
    return W, U
