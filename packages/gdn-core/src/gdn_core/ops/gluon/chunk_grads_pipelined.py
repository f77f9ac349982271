"""Backward stage (c), every chunk-local gradient, as ONE persistent Gluon kernel for
Hopper (sm_90a) that loads the next (chunk, value head) tile while it computes this one.

Same contract, arguments, results — and bits — as
:func:`gdn_core.ops.gluon.chunk_grads.chunk_grads_bwd_gluon` (that module's docstring
has the phases A–D, the shared-memory plan and the two rounding differences from the
Triton pair; ``docs/kernels.md``, "A Gluon chunk-gradient kernel"). The per-tile
arithmetic is that kernel's, statement for statement (its ``@gluon.jit`` helpers are
imported, not copied): only where the tiles sit in shared memory, when they are loaded
and which CTA computes a tile change, so every output bit is a function of its tile's
inputs alone and equals the original kernel's.

Why persistent and not two CTAs per SM (from the compile output of the original): its
8 warps hold 244 registers a thread, 62,464 of an SM's 65,536 — one CTA per SM by
registers alone, whatever shared memory it needs. Two CTAs of 8 warps would need ≤ 128
registers (phase D's live fp32 accumulators, two 64×128 and one 64×64, are 80 of them
alone), and the 4-warp build already spills at 255. Halving shared memory to
~110 KB would buy nothing, so the overlap has to come from inside the CTA: a persistent
grid that issues tile i+1's loads into buffers tile i has finished with.

Grid ``min(#SMs, NT·HV)``; CTA ``p`` takes tiles ``p, p + grid, …`` (tile ``t`` = chunk
``t // HV``, value head ``t % HV``: neighbouring CTAs share a chunk's Q/K rows in L2
with ``group > 1``). Shared memory is the original's 200 KiB of tiles, arranged so
the next tile's first-needed inputs land early (no byte more; 221,240 B with the seven
mbarriers, still one CTA per SM):

* a **ring of five** ``[64, 128]`` tiles for Q, dO, V, K, dU. At the j-th tile of a
  CTA, Q sits in slot ``j mod 5``, dO in ``j+1``, V (then dW) in ``j+2``, K in ``j+3``,
  dU in ``j+4``. Each prefetch takes the slot the current tile has just finished with,
  and that slot is exactly where the next tile's role lives (each role moves one slot
  on per tile):

  - P1, end of phase B (dO and dU spent: ``dO Sᵀ``, ``dU Sᵀ`` waited): next **Q**
    into dO's slot, next **K** into dU's slot — phases C and D of this tile
    overlap them;
  - P2a, phase D after ``Tᵀ dW`` (dW, ``A_inv`` spent): next **dO** into dW's slot,
    next **A_inv** into its own tile;
  - P2b, phase D after ``V' dSᵀ`` and ``⟨S, dS⟩`` (V', S, dS spent): next **V'**,
    **S**, **dS** into their own tiles;
  - P4, after the last product (Q, K spent): next **dU** into Q's slot, next **V**
    into K's slot — needed only in the second half of the next tile's phase A,
    after ``dO V'ᵀ``, ``Q Kᵀ``, ``ds`` and its crossing sums.

  So the next tile's phase A waits on nothing issued later than this tile's phase D
  (dO, V') or C/D (Q, K), and S / dS / ``A_inv`` have a whole tile of lead.
* V', ``h = S``, ``dh = dS``, ``A_inv`` and the 64×64 intermediates (ds, dT, E',
  diag(β)E') in their own buffers as before.
* one mbarrier per issue group (Q+K, dO, V', ``A_inv``, dU+V, S, dS); each completes
  once per tile, so the j-th tile waits on phase parity ``j & 1``.

Every prefetch is issued after a CTA barrier that follows both warpgroups' waits on
the last ``warpgroup_mma`` reading the buffer (each warpgroup reads every operand in
full), with a ``fence.proxy.async`` after the generic loads/stores of those tiles
(``⟨S, dS⟩``, ``k``, ``q``, ``v`` rows for the dot products, a short chunk's zeroing,
dW's store). The barrier after the last product also orders the next tile's ``ds``
store after the other warpgroup's last read of ``ds``. A CTA's last tile issues
nothing (predicated TMA and ``expect``).

A short chunk's zeroing (rows ≥ n, and ``A_inv``'s columns ≥ n) still waits for all of
its tile's phase-A inputs first, so it also waits for dU and V.

Compiled for sm_90a with Triton 3.6 on a machine without a GPU, not yet run on one
(``PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/sm90_report.py gluon_grads2``);
the figures are in ``docs/kernels.md`` ("A persistent Gluon chunk-gradient kernel")::

    warps=8: 255 / 255 registers, 0 spills, 221,240 B shared, 5,072 / 5,024 SASS
             instructions (the one-tile kernel: 244 / 242, 0, 221,216 B, 4,616 / 4,584);
             PTX: 96 wgmma (the same), 18 TMA copies (9 in the prologue, 9 in the loop),
             112 bar.sync (80)

The loop is ``tl.range(..., disable_licm=True)``: with LICM, LLVM hoists ~550
thread-invariant shared-memory address computations out of it and keeps them live through
every tile (255 registers, 476 B of spills).
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.gluon import chunk_grads as _cg
from gdn_core.ops.gluon.chunk_grads import (
    _chunk_vectors,
    _crossing_sums,
    _loop,
    _phase_a_scores,
    _phase_a_values,
    _phase_b_dq,
    _phase_b_dt,
    _phase_c,
    _phase_d_c,
    _phase_d_dk,
    _phase_d_state,
    _store_dg_dbeta,
    _store_rows,
    _zero_short_chunk,
    prepare_launch,
)
from gdn_core.ops.gluon.lang import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
)
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["GLUON_CHUNK_GRADS_PIPELINED_WARPS", "chunk_grads_bwd_gluon_pipelined",
           "gluon_chunk_grads_pipelined_supported", "persistent_grid", "tile_order"]

#: Warps of the kernel: two warpgroups, each owning half the columns of every product.
GLUON_CHUNK_GRADS_PIPELINED_WARPS = 8
_BT, _K, _V = 64, 128, 128
#: ring slots of the [64, 128] tiles Q, dO, V (then dW), K, dU at a CTA's j-th tile:
#: role -> slot offset (slot = (j + offset) mod 5); see the module docstring
RING = 5
SLOT = {"q": 0, "do": 1, "v": 2, "k": 3, "du": 4}


def tile_order(num_tiles: int, grid: int) -> list[list[int]]:
    """The tiles (``t`` = chunk ``t // HV``, value head ``t % HV``) each CTA of a
    ``grid``-wide launch computes, in its order: CTA ``p`` takes ``p, p + grid, …``."""
    return [list(range(p, num_tiles, grid)) for p in range(grid)]


def persistent_grid(num_tiles: int, num_sms: int) -> int:
    """CTAs of the launch: one per SM (the kernel holds one SM's registers), at most one
    per tile."""
    return max(1, min(num_tiles, num_sms))


def gluon_chunk_grads_pipelined_supported(q: torch.Tensor, v: torch.Tensor,
                                          A_inv: torch.Tensor, index: ChunkIndex) -> bool:
    """What :func:`~gdn_core.ops.gluon.chunk_grads.gluon_chunk_grads_supported` says."""
    return _cg.gluon_chunk_grads_supported(q, v, A_inv, index)


@gluon.jit
def _chunk_grads_bwd_gluon_pipelined_kernel(
    q_desc, k_desc, v_desc, vn_desc, do_desc, du_desc, h_desc, dh_desc, a_desc,
    G, beta, dq, dk, dv, dbeta, dg,
    chunk_start, chunk_len, scale, HV, n_tiles,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
):
    gl.static_assert(K == V)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    dtype: gl.constexpr = q_desc.dtype
    WG: gl.constexpr = gl.num_warps() // 4  # warpgroups; each owns 1/WG of the columns

    # --- register layouts (the original kernel's)
    L64: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BT // WG, 16])
    L128: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, V // WG, 16])
    R64: gl.constexpr = gl.SliceLayout(1, L64)
    C64: gl.constexpr = gl.SliceLayout(0, L64)
    R128: gl.constexpr = gl.SliceLayout(1, L128)
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4 * WG, 1],
        order=[1, 0])
    SCAN: gl.constexpr = gl.BlockedLayout(  # a column of a 64x64 tile in one warp
        size_per_thread=[2, 1], threads_per_warp=[32, 1], warps_per_cta=[1, 4 * WG],
        order=[0, 1])
    t64: gl.constexpr = a_desc.layout  # NVMMA layout of a [64, 64] 16-bit tile
    nb_tile: gl.constexpr = q_desc.block_type.nbytes  # one [64, 128] tile

    # --- shared memory: the ring of five [64, 128] tiles (Q, dO, V/dW, K, dU), V', S, dS,
    # A_inv and the 64x64 operands; all of it the original kernel's bytes
    ring = gl.allocate_shared_memory(dtype, [5, BT, K], q_desc.layout)
    vn_s = gl.allocate_shared_memory(dtype, [BT, V], vn_desc.layout)
    h_s = gl.allocate_shared_memory(dtype, [K, V], h_desc.layout)
    dh_s = gl.allocate_shared_memory(dtype, [K, V], dh_desc.layout)
    a_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # T = A_inv (row-major)
    ds_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # dP ⊙ D · scale
    dt_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # dT, then dT Tᵀ
    e_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # E'
    eb_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # diag(β) E'
    # barriers: 0 Q+K, 1 dO, 2 V', 3 A_inv, 4 dU+V, 5 S, 6 dS
    bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(7):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    b_qk = bars.index(0)
    b_do = bars.index(1)
    b_vn = bars.index(2)
    b_a = bars.index(3)
    b_uv = bars.index(4)
    b_h = bars.index(5)
    b_dh = bars.index(6)

    # --- the first tile's loads, in the order of use (dO, V', Q, K | dU, A_inv, V | S | dS)
    c0 = pid // HV
    hv0 = pid % HV
    bos0 = gl.load(chunk_start + c0)
    tv0 = hv0 * V
    tk0 = (hv0 // GROUP) * K
    st0 = (c0 * HV + hv0) * K
    mbarrier.expect(b_do, nb_tile)
    tma.async_copy_global_to_shared(do_desc, [bos0, tv0], b_do, ring.index(1))
    mbarrier.expect(b_vn, nb_tile)
    tma.async_copy_global_to_shared(vn_desc, [bos0, tv0], b_vn, vn_s)
    mbarrier.expect(b_qk, 2 * nb_tile)
    tma.async_copy_global_to_shared(q_desc, [bos0, tk0], b_qk, ring.index(0))
    tma.async_copy_global_to_shared(k_desc, [bos0, tk0], b_qk, ring.index(3))
    mbarrier.expect(b_a, a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [bos0, hv0 * BT], b_a, a_s)
    mbarrier.expect(b_uv, 2 * nb_tile)
    tma.async_copy_global_to_shared(du_desc, [bos0, tv0], b_uv, ring.index(4))
    tma.async_copy_global_to_shared(v_desc, [bos0, tv0], b_uv, ring.index(2))
    mbarrier.expect(b_h, h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(h_desc, [st0, 0], b_h, h_s)
    mbarrier.expect(b_dh, dh_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(dh_desc, [st0, 0], b_dh, dh_s)

    j = 0
    # disable_licm: LLVM would hoist ~550 thread-invariant shared-memory offsets (the
    # swizzled addresses of every load/store of the body) out of the loop, keeping them
    # live through every tile: 255 registers and ~480 B of spills; computed where used,
    # as the one-tile kernel computes them, they die at once
    for t in _loop(pid, n_tiles, nprog, disable_licm=True):
        ph = j & 1
        i_c = t // HV
        i_hv = t % HV
        bos = gl.load(chunk_start + i_c)
        n = gl.load(chunk_len + i_c)
        q_s = ring.index(j % 5)
        do_s = ring.index((j + 1) % 5)
        v_s = ring.index((j + 2) % 5)  # later: dW
        k_s = ring.index((j + 3) % 5)
        du_s = ring.index((j + 4) % 5)
        # the next tile of this CTA (its loads are issued when this tile frees their slots)
        t_n = t + nprog
        more = t_n < n_tiles
        t_n = gl.minimum(t_n, n_tiles - 1)
        c_n = t_n // HV
        hv_n = t_n % HV
        bos_n = gl.load(chunk_start + c_n)
        tv_n = hv_n * V

        # --- G, β, Γ of the chunk (masked: rows >= n read 0) while the copies fly
        rows = gl.arange(0, BT, layout=R64)
        cols = gl.arange(0, BT, layout=C64)
        p_s = bos.to(gl.int64) * HV + i_hv
        g_r, g_c, b_r, b_c, gam_r, gam_c, g_last, gam_r128, b_r128, kd128 = _chunk_vectors(
            G, beta, p_s, n, HV, rows, cols, R128)

        # --- a short chunk: rows >= n of every token tile (and T's columns >= n) to zero
        if n < BT:
            mbarrier.wait(b_do, ph)
            mbarrier.wait(b_vn, ph)
            mbarrier.wait(b_qk, ph)
            mbarrier.wait(b_a, ph)
            mbarrier.wait(b_uv, ph)
            _zero_short_chunk(q_s, k_s, v_s, vn_s, do_s, du_s, a_s, n, BT, K, V, IO, SCAN)

        z64 = gl.zeros([BT, BT], gl.float32, L64)
        z128 = gl.zeros([BT, V], gl.float32, L128)

        # ---- A: dP = dO V'ᵀ and Q Kᵀ; ds = dP ⊙ D · scale; Mo's crossing sums
        mbarrier.wait(b_do, ph)
        mbarrier.wait(b_vn, ph)
        dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), z64, use_acc=False, is_async=True)
        mbarrier.wait(b_qk, ph)
        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), z64, use_acc=False, is_async=True)
        mo = _phase_a_scores(dp, qk, do_s, vn_s, q_s, k_s, ds_s, rows, cols, g_r, g_c, n,
                             scale)
        mbarrier.wait(b_a, ph)
        mbarrier.wait(b_uv, ph)
        x1, db_v, cs_o = _phase_a_values(a_s, du_s, v_s, z64, z128, dv, p_s, b_r128, n, HV,
                                         mo, BT, V, L128, SCAN, R64, False)  # at 255 regs

        # ---- B: dQ_state = dO Sᵀ, -dW = dU Sᵀ; dQ = Γ scale dQ_state + ds K (stored)
        mbarrier.wait(b_h, ph)
        x1, dgq, dw_s = _phase_b_dq(x1, do_s, du_s, h_s, q_s, k_s, v_s, ds_s, z128, dq, dq,
                                    0, p_s * K, HV * K, 0, gam_r128, n, scale, 1, BT, K, L128)
        # P1: dO and dU are spent (both warpgroups waited on dO Sᵀ, dU Sᵀ): the next
        # tile's Q into dO's slot, its K into dU's slot
        tk_n = (hv_n // GROUP) * K
        mbarrier.expect(b_qk, 2 * nb_tile, pred=more)
        tma.async_copy_global_to_shared(q_desc, [bos_n, tk_n], b_qk, do_s, pred=more)
        tma.async_copy_global_to_shared(k_desc, [bos_n, tk_n], b_qk, du_s, pred=more)
        d_t = _phase_b_dt(x1, dw_s, k_s, z64, b_c, gam_c)

        # ---- C: E' = (−Tᵀ dT Tᵀ) ⊙ e on the strict lower triangle; K Kᵀ; Mw's crossing sums
        mw = _phase_c(d_t, dt_s, a_s, k_s, e_s, eb_s, z64, rows, cols, g_r, g_c, b_r, n)
        cs_w = _crossing_sums(mw, BT, SCAN, R64)  # before D (at 255 registers)

        # ---- D: dK = kd ⊙ V' dSᵀ + (dP ⊙ D)ᵀ scale Q + β ⊙ C + E'ᵀ (βK),
        #         C = Γ ⊙ (Tᵀ dW) + E' K
        acc = warpgroup_mma(a_s.permute((1, 0)), dw_s, z128, use_acc=False, is_async=True)
        mbarrier.wait(b_dh, ph)
        acc, dks, sds = _phase_d_state(acc, a_s, dw_s, vn_s, h_s, dh_s, z128, K, V, IO)
        # P2a: dW and A_inv are spent: the next tile's dO into dW's slot, its A_inv
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.expect(b_do, nb_tile, pred=more)
        tma.async_copy_global_to_shared(do_desc, [bos_n, tv_n], b_do, dw_s, pred=more)
        mbarrier.expect(b_a, a_desc.block_type.nbytes, pred=more)
        tma.async_copy_global_to_shared(a_desc, [bos_n, hv_n * BT], b_a, a_s, pred=more)
        acc, dks, k_r, wr = _phase_d_c(acc, dks, e_s, k_s, vn_s, dh_s, gam_r128, L128)
        # P2b: V', S, dS are spent (⟨S, dS⟩ read above): the next tile's V', S, dS
        gl.thread_barrier()
        st_n = (c_n * HV + hv_n) * K
        mbarrier.expect(b_vn, nb_tile, pred=more)
        tma.async_copy_global_to_shared(vn_desc, [bos_n, tv_n], b_vn, vn_s, pred=more)
        mbarrier.expect(b_h, h_desc.block_type.nbytes, pred=more)
        tma.async_copy_global_to_shared(h_desc, [st_n, 0], b_h, h_s, pred=more)
        mbarrier.expect(b_dh, dh_desc.block_type.nbytes, pred=more)
        tma.async_copy_global_to_shared(dh_desc, [st_n, 0], b_dh, dh_s, pred=more)
        acc, db_c, kds = _phase_d_dk(acc, dks, k_r, eb_s, ds_s, k_s, q_s, b_r128, kd128)
        # P4: Q and K are spent (and ds: the next tile may store over it): the next
        # tile's dU into Q's slot, its V into K's slot
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.expect(b_uv, 2 * nb_tile, pred=more)
        tma.async_copy_global_to_shared(du_desc, [bos_n, tv_n], b_uv, q_s, pred=more)
        tma.async_copy_global_to_shared(v_desc, [bos_n, tv_n], b_uv, k_s, pred=more)
        _store_rows(dk + p_s * K, acc, n, HV * K, BT, K, L128)

        # ---- dg, dβ (the Triton kernels' order of terms)
        _store_dg_dbeta(dg, dbeta, p_s, n, HV, rows, cols, cs_w, cs_o, g_last, sds, kds, wr,
                        dgq, db_c, db_v, b_r, R64)
        j += 1

    for i in gl.static_range(7):
        mbarrier.invalidate(bars.index(i))


_CHUNK_GRADS_BWD_GLUON_PIPELINED_KERNEL = cached_launch(_chunk_grads_bwd_gluon_pipelined_kernel)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@launcher(uses_atomics=False, kernels=(_chunk_grads_bwd_gluon_pipelined_kernel,))
def chunk_grads_bwd_gluon_pipelined(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    do: torch.Tensor,
    du: torch.Tensor,
    G: torch.Tensor,
    beta: torch.Tensor,
    A_inv: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    g_dtype: torch.dtype,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    dbeta: torch.Tensor | None = None,
    dg: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every chunk-local gradient after the state backward, in one persistent Gluon
    launch that prefetches each CTA's next tile (opt-in; not routed by ``GDN_CORE_GLUON``).

    Arguments, results, refusals and bits: those of
    :func:`gdn_core.ops.gluon.chunk_grads.chunk_grads_bwd_gluon`.

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks not of 64, the tiled
            tensors not of one 16-bit dtype, a ``dq``/``dk`` buffer of another shape or
            not contiguous, or more rows than TMA's int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    outs, ready = prepare_launch(q, k, v, v_new, h, dh, do, du, G, beta, A_inv, index, group,
                                 g_dtype, dq, dk, dv, dbeta, dg)
    if ready is not None:
        descs, G, beta = ready
        HV = v.shape[1]
        n_tiles = index.num_chunks * HV
        grid = persistent_grid(n_tiles, _num_sms(q.device))
        _CHUNK_GRADS_BWD_GLUON_PIPELINED_KERNEL[(grid,)](
            *descs.values(), G, beta, *outs, index.chunk_start, index.chunk_len, float(scale),
            HV, n_tiles, GROUP=group, K=_K, V=_V, BT=_BT,
            num_warps=GLUON_CHUNK_GRADS_PIPELINED_WARPS,
        )
    return outs
