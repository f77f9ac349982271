"""The reverse state recurrence and every chunk gradient in one warp-specialised launch, in
Gluon for Hopper (sm_90a): step 2 of ``docs/fused_backward.md`` §3.

Stage ``fused_bwd`` of :data:`gdn_core.ops.gluon.STAGES` (by name only until the H200 has
timed it), K = V = 128, chunks of 64, 16-bit inputs. With grouped value heads a CTA owns
one value head, so ``dq``/``dk`` come out as fp32 per-value-head partials for
:func:`~gdn_core.ops.group_reduce.group_reduce` (the summed chunk-gradient kernel's order,
so its bits). One launch
replaces :func:`~gdn_core.ops.gluon.fused_state_bwd.fused_state_bwd_gluon` (``store=True``)
followed by :func:`~gdn_core.ops.gluon.chunk_grads.chunk_grads_bwd_gluon`: the state
gradients ``dh`` and ``dV'`` never reach memory (3 units of one ``[T, HV, 128]`` 16-bit
tensor less at the backward's peak, ~96 KB less HBM traffic a (chunk, head)), and the
chunk gradients of a segment run in the same CTA as its reverse chain, chunk after chunk,
their tiles refilled as they die instead of loaded before every tile's math.

**Grid and partitions.** One CTA per (document, value head), walking the document's chunks
last first (documents longest first unless ``GDN_CORE_DOC_ORDER=0``; the bits do not
depend on the order). ``gl.warp_specialize`` splits it into (12 warps, 168 registers a
thread in each):

* **G** (default, 8 warps, two warpgroups): per chunk ``c``, first ``X = K_c·dS16_{c+1}``
  and ``dvl = round(round(scale·(K Qᵀ ⊙ decay ⊙ mask)) dO)`` (today's ``dv_local``), then
  ``dU = round(X ⊙ kd + dvl)`` (today's ``dV'``) into a shared tile for S; then the chunk
  gradients, phases A–D of :mod:`~gdn_core.ops.gluon.chunk_grads` (its very helpers) with
  ``dU`` and ``dS16_{c+1}`` (today's ``dh[c]``) from shared memory; after phase B it writes
  ``−round(Γ·scale ⊙ dO)`` over its spent ``dO`` tile for S. It issues the TMA loads of its
  own tiles (q, k, v, ``v_new``, ``A_inv``, ``h``) for chunk ``c − 1`` once phase D is done.
* **S** (worker, 4 warps, one warpgroup): the chain. It holds ``N = −dSᵀ`` (128×128 fp32,
  128 registers a thread) and, per chunk, once G has published ``dU`` and ``−dos``:
  ``N = exp(G_last)·N``, ``N += (−dos)ᵀ Q``, ``N += dUᵀ W`` (every operand from shared
  memory), then ``dS16_c = round(−N)`` into the ``dS`` tile once G is done reading
  ``dS16_{c+1}``. It loads ``W`` and ``dO`` (TMA) for chunk ``c − 1`` after its products,
  zeroes a short first chunk's foreign ``W`` rows, and stores ``dh0 = −N`` at the end.

**Bits.** Every product is formed with the operands, roundings and accumulation order of
the two kernels it replaces: the chain's ``dS_c = (γ dS + dosᵀ Q) − dUᵀ W`` in that order
on one accumulator, kept negated (``−((−A)·B + (−C)) = A·B + C`` elementwise; measured on
the H200 for wgmma, ``benchmarks/wgmma_operand_bits_probe.py``, session 19, where an A
operand from registers, a K-major or an MN-major shared tile also gave the same bits), and
``X = K·dS16`` as the transpose of the proven ``Xᵀ = dS16ᵀ Kᵀ`` (``(Bᵀ Aᵀ)ᵀ = A B``, same
probe). So ``dq, dk, dv, dg, dβ, dh0`` are meant to be bitwise those of the default path
(``fused_state`` then ``grads``); ``tests/test_gluon_fused_bwd_gpu.py`` checks it on the
GPU. Zeros may differ in sign only (an exact cancellation is ``+0`` either way before the
negation), which ``torch.equal`` does not see.

**mbarriers** (each completes once a chunk; a wait's parity is the chunk's ordinal & 1):
``ld_qk``, ``ld_vva``, ``ld_h`` (G's TMA, in three groups: a tile is refilled once it is
spent), ``ld_s`` (S's TMA: ``W``, ``dO``; both wait on it), ``du_ready`` and
``dos_ready`` (G → S), ``q_free`` (S → G: S's Q term is done, Q may be refilled),
``ds_free`` (G → S: ``dS16_{c+1}`` read for the last time) and ``ds_ready`` (S → G: the
``dS`` tile holds ``dS16_c``; also once before the first chunk, with ``round(dht)``). Every
arrival from a multi-warp partition follows ``fence_async_shared`` where generic shared
accesses precede async ones, and the partition-local ``thread_barrier``.

**Short chunks.** Only a document's last chunk (the first processed) can be short: G zeroes
rows ``≥ n`` of q, k, v, ``v_new``, dO and ``A_inv``'s rows and columns, S those of ``W``,
before any product (a select: NaN is cleared too), G and β are loaded masked and nothing is
stored past ``n``: the rules of both kernels it replaces, so a NaN cannot cross documents.

**Shared memory** (single-buffered; 16-bit tiles): q, k, v (then ``dW``), ``v_new``, dO
(then ``−dos``), ``dU``, ``W`` (7 × 16 KB), ``h`` and ``dS`` (2 × 32 KB), ``A_inv``, ``ds``
(first ``round(Pᵀ)`` for ``dvl``), ``dT`` (then ``dT Tᵀ``), ``E'``, ``diag(β)E'`` (5 ×
8 KB): 221,184 B of tiles, plus the compiler's scratch for the crossing sums' layout
conversions. The compile report (``tools/sm90_report.py fused_bwd``) gives the total.

Determinism: no atomics, each output row owned by one CTA, every sum in a fixed order.
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex, ordered_docs
from gdn_core.ops.chunk_grads_bwd import grad_outputs
from gdn_core.ops.gluon.chunk_grads import (
    _chunk_vectors,
    _crossing_sums,
    _phase_a_scores,
    _phase_a_values,
    _phase_b_dq,
    _phase_b_dt,
    _phase_c,
    _phase_d_c,
    _phase_d_dk,
    _phase_d_state,
    _state_dot,
    _store_dg_dbeta,
    _store_rows,
    _zero_rows,
    _zero_short_chunk,
)
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
from gdn_core.ops.gluon.tma import descriptor, rows_view
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

try:
    from triton.language import range as _loop  # tl.range: for its disable_licm
except ImportError:  # pragma: no cover - every Triton with Gluon has it
    _loop = range

__all__ = ["GLUON_FUSED_BWD_PREFETCH", "GLUON_FUSED_BWD_S_REGS", "fused_bwd_gluon",
           "gluon_fused_bwd_supported"]

#: Whether partition G hints the next chunk's Q and K rows into L2 at each chunk's start
#: (read at each call; loads only, never the arithmetic: the same bits either way).
GLUON_FUSED_BWD_PREFETCH = False
#: Registers a thread of the chain partition S (4 warps); G (8 warps) gets what is left of
#: 168 a thread over the 12 warps: ``(3·168 − S) / 2`` = 168 at 168.
GLUON_FUSED_BWD_S_REGS = 168
_MAXNREG = 168
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _issue_qk_loads(q_desc, k_desc, bar, q_s, k_s, t0, tk):
    """G's TMA loads of Q and K (the last tiles of a chunk to die) on ``bar``."""
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [t0, tk], bar, k_s)
    tma.async_copy_global_to_shared(q_desc, [t0, tk], bar, q_s)


@gluon.jit
def _issue_vva_loads(v_desc, vn_desc, a_desc, bar, v_s, vn_s, a_s, t0, tv, ta):
    """G's TMA loads of V, V' and ``A_inv`` (spent once phase D's first products are) on
    ``bar``."""
    mbarrier.expect(bar, 2 * v_desc.block_type.nbytes + a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(vn_desc, [t0, tv], bar, vn_s)
    tma.async_copy_global_to_shared(v_desc, [t0, tv], bar, v_s)
    tma.async_copy_global_to_shared(a_desc, [t0, ta], bar, a_s)


@gluon.jit
def _issue_h_load(h_desc, bar, h_s, th):
    """G's TMA load of the chunk's state ``h`` (spent after phase B) on ``bar``."""
    mbarrier.expect(bar, h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(h_desc, [th, 0], bar, h_s)


@gluon.jit
def _prefetch_l2(q2d, k2d, q_stride, k_stride, t0, tk, BT: gl.constexpr):
    """The next chunk's Q and K rows (``t0 … t0 + BT``, columns ``tk …`` of the 2-D views)
    hinted into L2 (``prefetch.global.L2``, one 128-byte line a thread: the 256-byte rows'
    two halves), so that their TMA loads after phase D read L2 rather than HBM."""
    PF: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                        warps_per_cta=[gl.num_warps()], order=[0])
    i = gl.arange(0, 4 * BT, layout=PF)
    row = (t0 + i % BT).to(gl.int64)
    half = (i // BT) % 2 * 64  # elements: 128 bytes of a 16-bit row
    pq = q2d + row * q_stride + tk + half
    pk = k2d + row * k_stride + tk + half
    ptr = gl.where(i < 2 * BT, pq, pk)
    gl.inline_asm_elementwise("mov.b32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptr],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stamp(stamps, slot, j, STAMPS: gl.constexpr):
    """With ``STAMPS``: the global timer (ns) into ``stamps[slot + j]`` (a probe's debug
    buffer; every thread of the partition stores the same value)."""
    if STAMPS:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [slot],
                                      dtype=gl.int64, is_pure=False, pack=1)
        gl.store(stamps + slot + j, t)


@gluon.jit
def _issue_s_loads(w_desc, do_desc, bar, w_s, do_s, t0, tw, tv):
    """S's two TMA loads of one chunk on ``bar``: ``W`` and ``dO``."""
    mbarrier.expect(bar, w_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [t0, tv], bar, do_s)
    tma.async_copy_global_to_shared(w_desc, [t0, tw], bar, w_s)


@gluon.jit
def _dvl_and_du(k_s, q_s, do_s, ds_s, dS_s, du_s, rows, cols, g_r, g_c, kd128, n, scale,
                z64, z128, BT: gl.constexpr, L128: gl.constexpr):
    """``dU = round(K·dS16 ⊙ kd + round(Pᵀ dO))`` into ``du_s`` (today's ``dV'``), with
    ``Pᵀ = round(scale · K Qᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j, i < n])`` passed through ``ds_s``
    (free until phase A): the products and roundings of ``dv_local`` and of the state
    backward's ``dV'``. Ends with a fence and a CTA barrier."""
    pt = warpgroup_mma(k_s, q_s.permute((1, 0)), z64, use_acc=False, is_async=True)
    x = warpgroup_mma(k_s, dS_s, z128, use_acc=False, is_async=True)
    pt = warpgroup_mma_wait(1, deps=[pt, k_s, q_s])[0]
    causal = (cols[None, :] >= rows[:, None]) & (cols[None, :] < n)
    decay = gl.exp(gl.where(causal, g_c[None, :] - g_r[:, None], 0.0))
    p = gl.where(causal, pt * decay * scale, 0.0)
    ds_s.store(p.to(ds_s.dtype))
    fence_async_shared()
    gl.thread_barrier()
    dvl = warpgroup_mma(ds_s, do_s, z128, use_acc=False, is_async=True)
    x = warpgroup_mma_wait(1, deps=[x, k_s, dS_s])[0]
    dvl = warpgroup_mma_wait(0, deps=[dvl, ds_s, do_s])[0]
    r128 = gl.arange(0, BT, layout=gl.SliceLayout(1, L128))
    dvl = gl.where((r128 < n)[:, None], dvl.to(du_s.dtype).to(gl.float32), 0.0)
    du_s.store((x * kd128[:, None] + dvl).to(du_s.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _neg_dos(do_s, gam_r, n, scale, IO: gl.constexpr):
    """``−round(dO ⊙ Γ·scale)`` over the spent ``dO`` tile (rows ``≥ n`` zero): the chain's
    Q-term operand, negated. Ends with a fence and a CTA barrier."""
    gam = gl.convert_layout(gam_r, gl.SliceLayout(1, IO))
    x = do_s.load(IO).to(gl.float32)
    do_s.store((-(x * (gam * scale)[:, None])).to(do_s.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _grads_partition(q_desc, k_desc, v_desc, vn_desc, a_desc, h_desc,
                     q_s, k_s, v_s, vn_s, do_s, du_s, h_s, dS_s, a_s, ds_s, dt_s, eb_s,
                     ld_qk, ld_vva, ld_h, ld_s, du_ready, dos_ready, q_free, ds_free, ds_ready,
                     G, beta, dq, dk, dv, dbeta, dg, doc_offsets, doc_chunk_offsets, i_n,
                     i_hv, HV, tk, tv, scale, q2d, k2d, q_stride, k_stride, stamps,
                     K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                     PREFETCH: gl.constexpr, STAMPS: gl.constexpr):
    """G (default, 8 warps): per chunk, ``dU`` for S, then phases A–D of the chunk
    gradients, ``−dos`` for S after phase B; the next chunk's tiles are loaded as they die
    (``h`` after phase B with ``⟨S, dS⟩`` formed there, V, V', ``A_inv`` after phase D's
    first products, Q and K at the end, with ``PREFETCH`` hinted into L2 at the chunk's
    start). ``STAMPS``: 8 timer stamps a chunk into ``stamps`` (the probe's breakdown)."""
    gl.static_assert(gl.num_warps() == 8)
    L64: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BT // 2, 16])
    L128: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, V // 2, 16])
    R64: gl.constexpr = gl.SliceLayout(1, L64)
    C64: gl.constexpr = gl.SliceLayout(0, L64)
    R128: gl.constexpr = gl.SliceLayout(1, L128)
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[8, 1], order=[1, 0])
    SCAN: gl.constexpr = gl.BlockedLayout(  # a column of a 64x64 tile in one warp
        size_per_thread=[2, 1], threads_per_warp=[32, 1], warps_per_cta=[1, 8], order=[0, 1])

    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)
    c0 = gl.load(doc_chunk_offsets + i_n)
    ta = i_hv * BT
    if n_chunks > 0:
        t_first = bos + (n_chunks - 1) * BT
        _issue_qk_loads(q_desc, k_desc, ld_qk, q_s, k_s, t_first, tk)
        _issue_vva_loads(v_desc, vn_desc, a_desc, ld_vva, v_s, vn_s, a_s, t_first, tv, ta)
        _issue_h_load(h_desc, ld_h, h_s, ((c0 + n_chunks - 1) * HV + i_hv) * K)
    rows = gl.arange(0, BT, layout=R64)
    cols = gl.arange(0, BT, layout=C64)
    prog = (gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)).to(gl.int64)
    # disable_licm: the body's thread-invariant shared-memory offsets hoisted out of the
    # loop would stay live through it (chunk_grads' reason too)
    for it in _loop(0, n_chunks, disable_licm=True):
        ph = it & 1
        ic = n_chunks - 1 - it
        t0 = bos + ic * BT
        n = gl.minimum(eos - t0, BT)
        has_next = it + 1 < n_chunks
        slot = (prog * 64 + gl.minimum(it, 63)) * 8
        _stamp(stamps, slot, 0, STAMPS)
        if PREFETCH:
            if has_next:
                _prefetch_l2(q2d, k2d, q_stride, k_stride, t0 - BT, tk, BT)
        p_s = t0.to(gl.int64) * HV + i_hv
        g_r, g_c, b_r, b_c, gam_r, gam_c, g_last, gam_r128, b_r128, kd128 = _chunk_vectors(
            G, beta, p_s, n, HV, rows, cols, R128)
        mbarrier.wait(ld_qk, ph)
        mbarrier.wait(ld_s, ph)
        if n < BT:  # the first chunk only; du_s is written below, after the zeroing
            mbarrier.wait(ld_vva, ph)
            _zero_short_chunk(q_s, k_s, v_s, vn_s, do_s, du_s, a_s, n, BT, K, V, IO, SCAN)
        mbarrier.wait(ds_ready, ph)
        _stamp(stamps, slot, 1, STAMPS)
        z64 = gl.zeros([BT, BT], gl.float32, L64)
        z128 = gl.zeros([BT, V], gl.float32, L128)
        _dvl_and_du(k_s, q_s, do_s, ds_s, dS_s, du_s, rows, cols, g_r, g_c, kd128, n, scale,
                    z64, z128, BT, L128)
        mbarrier.arrive(du_ready, count=1)
        _stamp(stamps, slot, 2, STAMPS)

        # ---- A: dP = dO V'ᵀ and Q Kᵀ; ds; Mo's crossing sums; dṼ, dv; X1 = dU Vᵀ
        mbarrier.wait(ld_vva, ph)
        dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), z64, use_acc=False, is_async=True)
        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), z64, use_acc=False, is_async=True)
        mo = _phase_a_scores(dp, qk, do_s, vn_s, q_s, k_s, ds_s, rows, cols, g_r, g_c, n,
                             scale)
        x1, db_v, cs_o = _phase_a_values(a_s, du_s, v_s, z64, z128, dv, p_s, b_r128, n, HV,
                                         mo, BT, V, L128, SCAN, R64)
        _stamp(stamps, slot, 3, STAMPS)
        # ---- B: dQ stored, dW into V's tile; −dos over the spent dO for S; ⟨S, dS⟩, after
        # which h is spent: the next chunk's loads into its tile; dT
        mbarrier.wait(ld_h, ph)
        p_o = p_s * K
        x1, dgq, dw_s = _phase_b_dq(x1, do_s, du_s, h_s, q_s, k_s, v_s, ds_s, z128, dq, dq,
                                    0, p_o, HV * K, 0, gam_r128, n, scale, 1, BT, K, L128)
        _neg_dos(do_s, gam_r, n, scale, IO)
        mbarrier.arrive(dos_ready, count=1)
        sds = _state_dot(h_s, dS_s, K, V, IO)
        if has_next:
            fence_async_shared()
            gl.thread_barrier()  # every warp's reads of h are done
            _issue_h_load(h_desc, ld_h, h_s, ((c0 + ic - 1) * HV + i_hv) * K)
        d_t = _phase_b_dt(x1, dw_s, k_s, z64, b_c, gam_c)
        _stamp(stamps, slot, 4, STAMPS)
        # ---- C: E', diag(β) E', K Kᵀ, Mw's crossing sums
        mw = _phase_c(d_t, dt_s, a_s, k_s, dt_s, eb_s, z64, rows, cols, g_r, g_c, b_r, n,
                      True)  # E' over dT Tᵀ
        e_s = dt_s
        _stamp(stamps, slot, 5, STAMPS)
        # ---- D: dK (the state term from dS16_{c+1} in the dS tile); after its first
        # products V, V' and A_inv are spent, after dK Q and K
        acc = warpgroup_mma(a_s.permute((1, 0)), dw_s, z128, use_acc=False, is_async=True)
        cs_w = _crossing_sums(mw, BT, SCAN, R64)  # while Tᵀ dW runs
        acc, dks, _ = _phase_d_state(acc, a_s, dw_s, vn_s, h_s, dS_s, z128, K, V, IO, False)
        acc, dks, k_r, wr = _phase_d_c(acc, dks, e_s, k_s, vn_s, dS_s, gam_r128, L128)
        if has_next:
            fence_async_shared()
            gl.thread_barrier()  # every warp's reads of V (dW), V', A_inv are done
            _issue_vva_loads(v_desc, vn_desc, a_desc, ld_vva, v_s, vn_s, a_s, t0 - BT, tv, ta)
        acc, db_c, kds = _phase_d_dk(acc, dks, k_r, eb_s, ds_s, k_s, q_s, b_r128, kd128)
        _store_rows(dk + p_o, acc, n, HV * K, BT, K, L128)
        fence_async_shared()  # every generic read of the tiles before TMA or S rewrites them
        gl.thread_barrier()
        mbarrier.arrive(ds_free, count=1)
        if has_next:  # Q also waits for S's Q term
            mbarrier.wait(q_free, ph)
            _issue_qk_loads(q_desc, k_desc, ld_qk, q_s, k_s, t0 - BT, tk)
        _stamp(stamps, slot, 6, STAMPS)
        _store_dg_dbeta(dg, dbeta, p_s, n, HV, rows, cols, cs_w, cs_o, g_last, sds, kds, wr,
                        dgq, db_c, db_v, b_r, R64)
        _stamp(stamps, slot, 7, STAMPS)


@gluon.jit
def _chain_partition(w_desc, do_desc, q_s, w_s, do_s, du_s, dS_s,
                     ld_s, du_ready, dos_ready, q_free, ds_free, ds_ready,
                     G, dht, dh0, doc_offsets, i_n, i_hv, HV, tw, tv, K: gl.constexpr,
                     V: gl.constexpr, BT: gl.constexpr, USE_DHT: gl.constexpr):
    """S (4 warps): ``N = −dSᵀ`` through the document's chunks, last first."""
    dtype: gl.constexpr = q_s.dtype
    LS: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1], order=[1, 0])
    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)
    if n_chunks > 0:
        _issue_s_loads(w_desc, do_desc, ld_s, w_s, do_s, bos + (n_chunks - 1) * BT, tw, tv)
    # N = −dSᵀ from dht (or 0): rows = value columns, columns = keys
    rv = gl.arange(0, V, layout=gl.SliceLayout(1, LS))
    ck = gl.arange(0, K, layout=gl.SliceLayout(0, LS))
    off_state = (i_n.to(gl.int64) * HV + i_hv) * (K * V)
    off_t = ck[None, :] * V + rv[:, None]
    if USE_DHT:
        nds = -(gl.load(dht + off_state + off_t).to(gl.float32))
    else:
        nds = gl.zeros([V, K], gl.float32, LS)
    # the first chunk's W: a short chunk's foreign rows to zero
    L0 = gl.minimum(eos - (bos + (n_chunks - 1) * BT), BT)
    if n_chunks > 0:
        mbarrier.wait(ld_s, 0)
        if L0 < BT:
            _zero_rows(w_s, L0, BT, K, IO)
            fence_async_shared()
            gl.thread_barrier()
    for it in range(0, n_chunks):
        ph = it & 1
        t0 = bos + (n_chunks - 1 - it) * BT
        L = gl.minimum(eos - t0, BT)
        # publish dS16_{c+1} (at the first chunk round(dht)) once G has read the last one
        mbarrier.wait(ds_free, ph ^ 1, pred=it > 0)
        dS_s.permute((1, 0)).store((-nds).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready, count=1)
        g_last = gl.load(G + (t0 + L - 1).to(gl.int64) * HV + i_hv)
        mbarrier.wait(ld_s, ph)
        mbarrier.wait(du_ready, ph)
        nds = nds * gl.exp(g_last)
        mbarrier.wait(dos_ready, ph)
        nds = warpgroup_mma(do_s.permute((1, 0)), q_s, nds, is_async=True)  # (−dos)ᵀ Q
        nds = warpgroup_mma(du_s.permute((1, 0)), w_s, nds, is_async=True)  # dUᵀ W
        nds = warpgroup_mma_wait(1, deps=[nds, do_s, q_s])[0]
        gl.thread_barrier()
        mbarrier.arrive(q_free, count=1)
        nds = warpgroup_mma_wait(0, deps=[nds, du_s, w_s])[0]
        gl.thread_barrier()
        if it + 1 < n_chunks:
            _issue_s_loads(w_desc, do_desc, ld_s, w_s, do_s, t0 - BT, tw, tv)
    # dh0 = dS_0 (offsets through an opaque zero, as the state kernels do)
    zero = gl.load(doc_offsets + i_n + 1) - eos
    off_e = (ck + zero)[None, :] * V + rv[:, None]
    gl.store(dh0 + off_state + off_e, -nds)


@gluon.jit
def _fused_bwd_gluon_kernel(
    q_desc, k_desc, v_desc, vn_desc, w_desc, do_desc, h_desc, a_desc,
    G, beta, dht, dq, dk, dv, dbeta, dg, dh0, doc_offsets, doc_chunk_offsets, doc_order,
    scale, HV, q2d, k2d, q_stride, k_stride, stamps,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    USE_DHT: gl.constexpr, S_REGS: gl.constexpr, ORDERED: gl.constexpr = False,
    PREFETCH: gl.constexpr = False,
    STAMPS: gl.constexpr = False,
):
    gl.static_assert(K == V)
    i_hv = gl.program_id(0)
    i_n = _doc_program(doc_order, ORDERED)
    dtype: gl.constexpr = q_desc.dtype
    t64: gl.constexpr = a_desc.layout
    q_s = gl.allocate_shared_memory(dtype, [BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)  # later: dW
    vn_s = gl.allocate_shared_memory(dtype, [BT, V], vn_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [BT, K], w_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [BT, V], do_desc.layout)  # later: −dos
    du_s = gl.allocate_shared_memory(dtype, [BT, V], do_desc.layout)
    h_s = gl.allocate_shared_memory(dtype, [K, V], h_desc.layout)
    dS_s = gl.allocate_shared_memory(dtype, [K, V], h_desc.layout)
    a_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)
    ds_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # round(Pᵀ), then dP ⊙ D · scale
    dt_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # dT, dT Tᵀ, then E'
    eb_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)
    bars = gl.allocate_shared_memory(gl.int64, [9, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(9):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    ld_s = bars.index(0)
    du_ready = bars.index(1)
    dos_ready = bars.index(2)
    q_free = bars.index(3)
    ds_free = bars.index(4)
    ds_ready = bars.index(5)
    ld_qk = bars.index(6)
    ld_vva = bars.index(7)
    ld_h = bars.index(8)
    tk = (i_hv // GROUP) * K  # the q/k head's columns of Q, K
    tw = i_hv * K  # W: one per value head
    tv = i_hv * V
    gl.warp_specialize([
        (_grads_partition, (q_desc, k_desc, v_desc, vn_desc, a_desc, h_desc, q_s, k_s, v_s,
                            vn_s, do_s, du_s, h_s, dS_s, a_s, ds_s, dt_s, eb_s, ld_qk,
                            ld_vva, ld_h, ld_s, du_ready, dos_ready, q_free, ds_free,
                            ds_ready, G, beta, dq, dk, dv, dbeta, dg, doc_offsets,
                            doc_chunk_offsets, i_n, i_hv, HV, tk, tv, scale, q2d, k2d,
                            q_stride, k_stride, stamps, K, V, BT, PREFETCH, STAMPS)),
        (_chain_partition, (w_desc, do_desc, q_s, w_s, do_s, du_s, dS_s, ld_s, du_ready,
                            dos_ready, q_free, ds_free, ds_ready, G, dht, dh0, doc_offsets,
                            i_n, i_hv, HV, tw, tv, K, V, BT, USE_DHT)),
    ], [4], [S_REGS])


_FUSED_BWD_GLUON_KERNEL = cached_launch(_fused_bwd_gluon_kernel)


def gluon_fused_bwd_supported(q: torch.Tensor, v: torch.Tensor, A_inv: torch.Tensor,
                              index: ChunkIndex) -> bool:
    """Whether :func:`fused_bwd_gluon` serves these shapes and dtypes (the device is not
    checked, nor the other tensors): K = V = 128, chunks of 64, q, v and A_inv of one
    16-bit dtype."""
    return (q.shape[-1] == _K and v.shape[-1] == _V and index.chunk_size == _BT
            and q.dtype in (torch.bfloat16, torch.float16)
            and v.dtype == q.dtype and A_inv.dtype == q.dtype)


def _descriptors(q, k, v, v_new, W, do, h, A_inv) -> dict:
    """TMA descriptors over the 2-D views the kernel tiles (CPU tensors suffice, for
    :mod:`tools.sm90_report`); ``q``/``k`` may be given as their 2-D views already."""
    K, V = _K, _V
    return dict(
        q_desc=descriptor(q, [_BT, K]),
        k_desc=descriptor(k, [_BT, K]),
        v_desc=descriptor(v, [_BT, V]),
        vn_desc=descriptor(v_new, [_BT, V]),
        w_desc=descriptor(W, [_BT, K]),
        do_desc=descriptor(do, [_BT, V]),
        h_desc=descriptor(h.flatten(0, 2), [K, V]),
        a_desc=descriptor(A_inv, [_BT, _BT]),
    )


@launcher(uses_atomics=False, kernels=(_fused_bwd_gluon_kernel,))
def fused_bwd_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    W: torch.Tensor,
    do: torch.Tensor,
    G: torch.Tensor,
    beta: torch.Tensor,
    A_inv: torch.Tensor,
    dht: torch.Tensor | None,
    scale: float,
    index: ChunkIndex,
    g_dtype: torch.dtype,
    *,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    dh0: torch.Tensor | None = None,
    stamps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """The reverse state recurrence and every chunk gradient in one Gluon launch.

    ``q, k: [T,H,128]``; ``v, v_new, W, do: [T,HV,128]`` (value head ``hv`` reads q/k head
    ``hv // (HV/H)``); ``h: [NT,HV,128,128]`` (the recompute's states); ``G, beta: [T,HV]``
    (``G`` fp32, another float dtype is cast); ``A_inv: [T,HV,64]`` (the 16-bit inverse);
    ``dht: [N,HV,128,128]`` (any float dtype) or ``None``; ``q, k, v, v_new, W, do, h,
    A_inv`` in one 16-bit dtype. ``dq``/``dk``: result buffers, contiguous: with one value
    head per q/k head ``[T,H,128]`` in any float dtype (fp32 for the L2-norm backward;
    default q's dtype), else the per-value-head partials ``[T,HV,128]`` (default fp32) that
    :func:`~gdn_core.ops.group_reduce.group_reduce` sums in the order of the summed
    chunk-gradient kernel; ``dv``: that of ``dv`` (``[T,HV,128]`` in v's dtype); ``dh0``:
    that of ``dh0`` (may be ``dht``).

    Results over inputs (:func:`gdn_core.ops.backward.backward_from_recompute` asks for
    them where the inputs are its own): ``dv`` may be ``W``'s buffer and, with one value head
    per q/k head, ``dq`` ``v_new``'s. A CTA stores a chunk's ``dv`` rows in phase A and its
    ``dq`` rows in phase B, after that chunk's ``W`` and ``v_new`` tiles have landed in shared
    memory (``W`` is loaded during the chunk before, ``v_new`` before phase A), and no other
    CTA reads those rows but through a short chunk's tile past its document's end, whose
    rows are zeroed before any product: the kernel's results do not depend on the order.
    ``stamps``: a probe's int64 buffer of ``8 · 64`` per program (``HV × N``): partition
    G's timer at eight points of each of a program's first 64 chunks
    (``benchmarks/gluon_fused_bwd_probe.py --stamps`` reads them).

    Returns:
        ``(dq, dk, dv [T,HV,128] in v's dtype, dbeta [T,HV] in beta's dtype, dg [T,HV] in
        g_dtype, dh0 [N,HV,128,128] fp32)``: what ``fused_state_bwd_gluon`` then
        ``chunk_grads_bwd_gluon`` return (by construction; checked on the GPU).

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks
            not of 64, the tiled tensors not of one 16-bit dtype, a ``dq``/``dk``/``dv``/``dh0``
            buffer of another shape (or not contiguous), or more rows than TMA's int32
            coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N, NT = index.num_docs, index.num_chunks
    token = (v, v_new, W, do)
    if (
        tuple(k.shape) != (T, H, K)
        or any(tuple(x.shape) != (T, HV, x.shape[2]) for x in token)
        or tuple(h.shape) != (NT, HV, K, V)
        or tuple(G.shape) != (T, HV) or tuple(beta.shape) != (T, HV)
        or tuple(A_inv.shape) != (T, HV, index.chunk_size)
        or (dht is not None and tuple(dht.shape) != (N, HV, K, V))
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"v_new {tuple(v_new.shape)}, W {tuple(W.shape)}, do {tuple(do.shape)}, "
            f"h {tuple(h.shape)}, G {tuple(G.shape)}, beta {tuple(beta.shape)}, "
            f"A_inv {tuple(A_inv.shape)}, dht {None if dht is None else tuple(dht.shape)}, "
            f"chunks {NT}, docs {N}")
    if H == 0 or HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of the q/k heads H={H}")
    group = HV // H
    if (K, V) != (_K, _V) or W.shape[2] != K or index.chunk_size != _BT:
        raise ValueError(f"the Gluon fused backward serves K = V = {_K} and chunks of {_BT}, "
                         f"got K={K}, V={V}, chunk size {index.chunk_size}")
    tiled = (q, k, v, v_new, W, do, h, A_inv)
    if q.dtype not in (torch.bfloat16, torch.float16) or any(x.dtype != q.dtype for x in tiled):
        raise ValueError("the Gluon fused backward takes q, k, v, v_new, W, do, h, A_inv in "
                         "one 16-bit dtype, got " + ", ".join(str(x.dtype) for x in tiled))
    if max(T, NT * HV * K) >= 2**31:
        raise ValueError(f"T={T} / NT*HV*K={NT * HV * K} exceed TMA's int32 coordinates")
    outs, shape = [], (T, HV, K)  # [T, H, K] with group 1
    for name, buf, dt in (("dq", dq, q.dtype), ("dk", dk, k.dtype)):
        if buf is None:
            buf = torch.empty(shape, dtype=dt if group == 1 else torch.float32,
                              device=q.device)
        elif tuple(buf.shape) != shape or not buf.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {shape} tensor, got "
                             f"{tuple(buf.shape)} (contiguous={buf.is_contiguous()})")
        outs.append(buf)
    if dh0 is not None and (tuple(dh0.shape) != (N, HV, K, V) or dh0.dtype != torch.float32
                            or not dh0.is_contiguous()):
        raise ValueError(f"dh0 must be a contiguous fp32 {(N, HV, K, V)} tensor, got "
                         f"{dh0.dtype} {tuple(dh0.shape)}")
    require_sm90(q.device, "the Gluon fused backward")
    dq, dk = outs
    dv, dbeta, dg = grad_outputs(T, HV, V, v, beta, g_dtype, dv, None, None)
    if dh0 is None:
        dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    if N == 0 or HV == 0 or T == 0:
        return dq, dk, dv, dbeta, dg, dh0
    if dht is not None:
        dht = dht.contiguous()
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    beta = beta.contiguous()
    if stamps is not None and (stamps.dtype != torch.int64 or stamps.numel() < HV * N * 512
                               or not stamps.is_contiguous()):
        raise ValueError(f"stamps must be a contiguous int64 tensor of at least "
                         f"{HV * N * 512} elements")
    q2d, k2d = rows_view(q), rows_view(k)  # the views TMA tiles (and the L2 hints read)
    descs = _descriptors(q2d, k2d, v, v_new, W, do, h, A_inv)
    order = ordered_docs(index)
    _FUSED_BWD_GLUON_KERNEL[(HV, N)](
        *descs.values(), G, beta, dht if dht is not None else dh0, dq, dk, dv, dbeta, dg, dh0,
        index.doc_offsets, index.doc_chunk_offsets,
        index.doc_chunk_offsets if order is None else order, float(scale), HV,
        q2d, k2d, q2d.stride(0), k2d.stride(0), dh0 if stamps is None else stamps,
        GROUP=group, K=_K, V=_V, BT=_BT, USE_DHT=dht is not None,
        S_REGS=GLUON_FUSED_BWD_S_REGS,
        ORDERED=order is not None, PREFETCH=GLUON_FUSED_BWD_PREFETCH,
        STAMPS=stamps is not None, num_warps=8, maxnreg=_MAXNREG,
    )
    return dq, dk, dv, dbeta, dg, dh0
