"""The backward's recompute in one warp-specialised Gluon launch for Hopper (sm_90a): stage
``recompute``, K = V = 128, chunks of 64, 16-bit inputs.

Today the backward opens with two launches that move the same rows twice:
:func:`gdn_core.ops.wy.wy_apply` (``W = A_inv diag(β e^G) K``, ``U = A_inv diag(β) V`` from
the forward's 16-bit inverse: reads k, v, ``A_inv``, writes W, U) and
:func:`gdn_core.ops.chunk_state.chunk_state_fwd` with ``store_states`` (reads k, W, U,
writes every chunk state ``h`` and ``v_new``). Both are bound by HBM (Nsight Compute,
session 20: 72 % and 71 % of its peak; 0.18 + 0.20 ms at B1 T32768 H16 8 documents).
This kernel forms W and U on chip where the recurrence reads them: it reads k, v and
``A_inv``, writes ``W`` (the reverse passes read it), ``h`` and ``v_new`` — U is never in
memory — about 0.87 GB instead of 1.41 at that shape, in one launch instead of two.

One CTA per (document, value head) with all 128 value columns, two partitions:

* **S** (default, 8 warps = two warpgroups): the recurrence of
  :mod:`gdn_core.ops.gluon.fused_fwd`'s chain partition, statement for statement —
  ``h_c = round(S)`` (published in a shared tile and sent to ``h`` by TMA), ``P = W h_c``,
  ``V' = U − P``, ``vo = round(V')`` (sent to ``v_new``), ``vd = round(V' ⊙ e^{G_last − G})``
  over the spent U tile, ``S ← e^{G_last} S + Kᵀ vd``. It issues the TMA loads of k, v and
  ``A_inv`` into a ring of :data:`GLUON_RECOMPUTE_STAGES` stages.
* **F** (worker, 4 warps): for each chunk, as soon as its inputs land and its W/U stage is
  free, forms ``W`` and ``U`` in that stage — ``round(K ⊙ (β e^G))`` written into the W tile,
  ``W = A_inv ·`` it (a wgmma reading the tile, then its rounded result over it), the same
  for ``U`` with ``round(V ⊙ β)`` — sends W to memory by TMA and hands both to S. So the
  products S waits for are formed a chunk ahead, off S's chain.

**Bits.** ``W`` and ``U`` are the statements of the Triton ``wy_apply`` tile routine
(``_wy_apply_tiles``: the scale ``β · e^G`` in fp32, ``K`` times it rounded to 16 bits, one
fp32-accumulated dot with the 16-bit inverse, rounded), each a wgmma over the chunk's 64
rows in k16 steps as Triton's ``tl.dot`` issues it on sm_90 (value columns independent);
the chain is the fused forward's, which the H200 showed bitwise equal to the Triton
recurrence. So ``W``, ``h`` and ``v_new`` are bitwise the two launches' outputs
(``tests/test_gluon_recompute_gpu.py``, 9 passed on the H200, session 21: bf16/fp16,
group 1/2, entry states, packed documents, a strided ``v``, the det API end to end).

**Hand-offs** (mbarriers; a stage's phase is ``(c // STAGES) & 1``): ``ld_ready[s]`` (S's
expect-tx: k, v, ``A_inv`` of a chunk), ``wu_ready[s]`` (F → S: W and U formed),
``wu_free[s]`` (S → F: chunk ``c``'s update has read its U/vd tile, F may form chunk
``c + STAGES`` there). S refills an input stage after its update has read the K tile (F
read k, v and ``A_inv`` before its ``wu_ready``). Every arrival follows
``fence_async_shared`` and the partition's ``thread_barrier``.

**Short chunks** (a document's last, ``n < 64``): TMA reads whole tiles, so rows ``≥ n``
hold the next document's rows. F selects rows ``≥ n`` of ``K ⊙ (β e^G)`` and ``V ⊙ β`` to 0
(a select: a NaN there stays out; the stored inverse's columns ``≥ n`` are 0), stores W's
rows ``< n`` from registers; S zeroes K's rows ``≥ n`` (after F has read them), selects
V' rows ``≥ n`` to 0 and stores ``v_new`` rows ``< n`` from registers. ``h`` is a whole
``[128, 128]`` tile a chunk (TMA).

Shared memory (bf16): the input ring 2 × (k 16 + v 16 + ``A_inv`` 8) KiB, the W/U ring
2 × 32 KiB, ``h_c`` 32 KiB, ``vo`` 16 KiB: 192 KiB, one CTA an SM. Determinism: no atomics,
one CTA owns each output row, every reduction in a fixed order.

Compiled for sm_90a with Triton 3.6 (``PYTHONPATH=/tmp/t36:packages/gdn-core/src python
tools/sm90_report.py gluon_recompute``, bf16, group 1 and 2 alike)::

    setmaxnreg S 176 / F 152, no spills, 196,868 B shared, 1,976 SASS, 20 wgmma

On the H200 (session 21, ``benchmarks/gluon_recompute_probe.py --docs 8``, B1 T32768 H16,
12 segments of ≤ 4096 × 16 heads): 0.261 ms against 0.421 for the pair (0.62×). End to end
the det step gained 0.33 ms at 32 value heads (4.82 → 4.49 ms) but was slower at 16 in a
noisy call (`benchmarks/results/2026-12-04-h200-s21.md`), so the stage runs only where
named until a GPU timeline says why.
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex, ordered_docs
from gdn_core.ops.gluon.fused_fwd import _chain_update, _chain_values, _zero_rows_from
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
from gdn_core.ops.gluon.wy import check_wy_inputs
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["GLUON_RECOMPUTE_F_REGS", "GLUON_RECOMPUTE_STAGES", "chunk_recompute_gluon",
           "gluon_recompute_supported"]

#: TMA ring stages of the inputs (k, v, A_inv of one chunk: 40 KiB a stage) and of the
#: formed W, U (32 KiB a stage)
GLUON_RECOMPUTE_STAGES = 2
#: registers of partition F (4 warps); S (8 warps) gets ``(3 · 168 − F) / 2``
GLUON_RECOMPUTE_F_REGS = 152
_MAXNREG = 168  # 12 warps · 32 threads · 168 ≤ 64 K
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _issue_inputs(k_desc, v_desc, a_desc, bar, k_s, v_s, a_s, t0, tk, tv, ta):
    """The three TMA loads of one chunk (k, v, ``A_inv``) into one ring stage."""
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes
                    + a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [t0, tk], bar, k_s)
    tma.async_copy_global_to_shared(v_desc, [t0, tv], bar, v_s)
    tma.async_copy_global_to_shared(a_desc, [t0, ta], bar, a_s)


@gluon.jit
def _scaled_rows(x_s, scale, rio, n, IO: gl.constexpr):
    """``round(X ⊙ scale[:, None])`` of a ``[64, 128]`` shared tile, rows ``≥ n`` 0."""
    x = x_s.load(IO).to(gl.float32)
    return gl.where((rio < n)[:, None], x * scale[:, None], 0.0).to(x_s.dtype)


@gluon.jit
def _beta_and_gate(beta, G, t0, i_hv, HV, rio, n):
    """``(β, G)`` of the chunk at row ``t0`` of value head ``i_hv`` as fp32 in ``rio``'s
    layout, 0 past ``n``."""
    p_r = t0.to(gl.int64) * HV + i_hv
    b = gl.load(beta + p_r + rio * HV, mask=rio < n, other=0.0).to(gl.float32)
    return b, gl.load(G + p_r + rio * HV, mask=rio < n, other=0.0)


@gluon.jit
def _form_wu(k_t, v_t, a_t, w_t, u_t, b, g, rio, n, zw, IO: gl.constexpr):
    """One chunk's ``W`` and ``U`` formed into the tiles ``w_t`` and ``u_t`` (``u_t`` may be
    ``v_t`` itself: each thread rewrites the elements it read): ``round(K ⊙ (β e^G))`` into
    ``w_t`` and ``round(V ⊙ β)`` into ``u_t`` (rows ``≥ n`` 0), then ``W = A_inv ·`` the one
    over it and ``U = A_inv ·`` the other over that; fenced and CTA-barriered for a wgmma
    that reads them. ``b``, ``g``: the chunk's ``β`` and ``G`` in ``rio``'s layout, 0 past
    ``n``; ``zw``: a zero ``[64, 128]`` accumulator. Returns ``W`` (16-bit, ``zw``'s
    layout) for a masked store. Shared with :mod:`gdn_core.ops.gluon.fused_fwd_formed`."""
    dtype: gl.constexpr = k_t.dtype
    w_t.store(_scaled_rows(k_t, b * gl.exp(g), rio, n, IO))
    u_t.store(_scaled_rows(v_t, b, rio, n, IO))
    fence_async_shared()
    gl.thread_barrier()
    w = warpgroup_mma(a_t, w_t, zw, use_acc=False, is_async=True)
    w = warpgroup_mma_wait(0, deps=[w, a_t, w_t])[0].to(dtype)
    u = warpgroup_mma(a_t, u_t, zw, use_acc=False, is_async=True)
    gl.thread_barrier()  # every warp's W product has read the operand tile
    w_t.store(w)
    u = warpgroup_mma_wait(0, deps=[u, a_t, u_t])[0].to(dtype)
    gl.thread_barrier()
    u_t.store(u)
    fence_async_shared()
    gl.thread_barrier()
    return w


@gluon.jit
def _form_partition(k_s, v_s, a_s, w_s, u_s, ld_ready, wu_ready, wu_free, w_desc, G, beta,
                    W, doc_offsets, i_n, i_hv, HV, tw, K: gl.constexpr, BT: gl.constexpr,
                    STAGES: gl.constexpr):
    """F (worker, 4 warps): each chunk's ``W`` and ``U`` formed into its W/U stage; W also
    sent to memory."""
    WL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1], order=[1, 0])
    RIO: gl.constexpr = gl.SliceLayout(1, IO)
    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)
    rio = gl.arange(0, BT, layout=RIO)
    rw = gl.arange(0, BT, layout=gl.SliceLayout(1, WL))
    cw = gl.arange(0, K, layout=gl.SliceLayout(0, WL))
    zw = gl.zeros([BT, K], gl.float32, WL)
    for c in range(0, n_chunks):
        s = c % STAGES
        t0 = bos + c * BT
        n = gl.minimum(eos - t0, BT)
        b, g = _beta_and_gate(beta, G, t0, i_hv, HV, rio, n)
        if c >= STAGES:  # S's update of chunk c - STAGES has read this stage's U/vd tile
            mbarrier.wait(wu_free.index(s), ((c - STAGES) // STAGES) & 1)
        # W's store from this stage (chunk c - STAGES) has read it: at most one store a
        # chunk, so at most STAGES - 1 younger ones may still be in flight
        tma.store_wait(STAGES - 1)
        mbarrier.wait(ld_ready.index(s), (c // STAGES) & 1)
        w = _form_wu(k_s.index(s), v_s.index(s), a_s.index(s), w_s.index(s), u_s.index(s), b,
                     g, rio, n, zw, IO)
        mbarrier.arrive(wu_ready.index(s), count=1)
        if n == BT:
            tma.async_copy_shared_to_global(w_desc, [t0, tw], w_s.index(s))
        else:  # rows < n only: a TMA box would write the next document's rows
            offs = (t0 + rw).to(gl.int64)[:, None] * (HV * K) + (tw + cw)[None, :]
            gl.store(W + offs, w, mask=(rw < n)[:, None] & (cw < K)[None, :])
    tma.store_wait(0)


@gluon.jit
def _chain_partition(k_desc, v_desc, a_desc, h_desc, vn_desc, k_s, v_s, a_s, w_s, u_s, h_s,
                     vo_s, ld_ready, wu_ready, wu_free, G, h0, v_new, doc_offsets,
                     doc_chunk_offsets, i_n, i_hv, HV, tk, tv, ta, K: gl.constexpr,
                     V: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                     USE_H0: gl.constexpr):
    """S (default, 8 warps): the loads, the recurrence, ``h`` and ``v_new`` stored."""
    gl.static_assert(gl.num_warps() == 8)
    dtype: gl.constexpr = k_s.dtype
    SL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, V, 16])
    PL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, V // 2, 16])
    RP: gl.constexpr = gl.SliceLayout(1, PL)
    CP: gl.constexpr = gl.SliceLayout(0, PL)
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1], order=[1, 0])
    RIO: gl.constexpr = gl.SliceLayout(1, IO)
    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)
    c0 = gl.load(doc_chunk_offsets + i_n)

    for j in gl.static_range(STAGES):
        if j < n_chunks:
            _issue_inputs(k_desc, v_desc, a_desc, ld_ready.index(j), k_s.index(j),
                          v_s.index(j), a_s.index(j), bos + j * BT, tk, tv, ta)

    rk = gl.arange(0, K, layout=gl.SliceLayout(1, SL))
    cv = gl.arange(0, V, layout=gl.SliceLayout(0, SL))
    if USE_H0:
        st_base = (i_n * HV + i_hv).to(gl.int64) * (K * V)
        S = gl.load(h0 + st_base + rk[:, None] * V + cv[None, :])
    else:
        S = gl.zeros([K, V], gl.float32, SL)
    rows = gl.arange(0, BT, layout=RP)
    cols = gl.arange(0, V, layout=CP)
    rio = gl.arange(0, BT, layout=RIO)
    zp = gl.zeros([BT, V], gl.float32, PL)

    for c in range(0, n_chunks):
        s = c % STAGES
        t0 = bos + c * BT
        n = gl.minimum(eos - t0, BT)
        p_g = G + (t0.to(gl.int64) * HV + i_hv)
        g = gl.load(p_g + rows * HV, mask=rows < n, other=0.0)
        g_last = gl.load(p_g + (n - 1) * HV)
        tma.store_wait(0)  # the previous chunk's h and v_new stores have read h_s, vo_s
        gl.thread_barrier()
        # h_c = round(S): stored as h, W's operand here
        h_s.store(S.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(h_desc, [((c0 + c) * HV + i_hv) * K, 0], h_s)
        mbarrier.wait(ld_ready.index(s), (c // STAGES) & 1)  # S reads K after the copy too
        mbarrier.wait(wu_ready.index(s), (c // STAGES) & 1)  # W, U formed
        if n < BT:  # a document's short last chunk: K's foreign rows to 0 before the update
            _zero_rows_from(k_s.index(s), n, rio, IO)
        S, vo = _chain_values(w_s.index(s), h_s, u_s.index(s), vo_s, S, g, g_last, rows, n, zp,
                              PL)
        if n == BT:
            tma.async_copy_shared_to_global(vn_desc, [t0, tv], vo_s)
        else:  # rows < n only
            offs = (t0 + rows).to(gl.int64)[:, None] * (HV * V) + (tv + cols)[None, :]
            gl.store(v_new + offs, vo, mask=(rows < n)[:, None] & (cols < V)[None, :])
        S = _chain_update(k_s.index(s), u_s.index(s), S)
        gl.thread_barrier()  # every warp's update has read the K and vd tiles
        mbarrier.arrive(wu_free.index(s), count=1)
        if c + STAGES < n_chunks:
            _issue_inputs(k_desc, v_desc, a_desc, ld_ready.index(s), k_s.index(s),
                          v_s.index(s), a_s.index(s), t0 + STAGES * BT, tk, tv, ta)
    tma.store_wait(0)


@gluon.jit
def _recompute_gluon_kernel(
    k_desc, v_desc, a_desc, w_desc, h_desc, vn_desc, G, beta, h0, W, v_new, doc_offsets,
    doc_chunk_offsets, doc_order, HV,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    STAGES: gl.constexpr, USE_H0: gl.constexpr, F_REGS: gl.constexpr,
    ORDERED: gl.constexpr = False,
):
    gl.static_assert(STAGES >= 1)
    i_hv = gl.program_id(0)
    i_n = _doc_program(doc_order, ORDERED)
    i_h = i_hv // GROUP
    dtype: gl.constexpr = k_desc.dtype

    k_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], k_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [STAGES, BT, V], v_desc.layout)
    a_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BT], a_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], w_desc.layout)  # operand, W
    u_s = gl.allocate_shared_memory(dtype, [STAGES, BT, V], vn_desc.layout)  # op., U, vd
    h_s = gl.allocate_shared_memory(dtype, [K, V], h_desc.layout)
    vo_s = gl.allocate_shared_memory(dtype, [BT, V], vn_desc.layout)
    ld_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    wu_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    wu_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ld_ready.index(i), count=1)
        mbarrier.init(wu_ready.index(i), count=1)
        mbarrier.init(wu_free.index(i), count=1)
    fence_async_shared()

    tk = i_h * K
    tv = i_hv * V
    gl.warp_specialize([
        (_chain_partition, (k_desc, v_desc, a_desc, h_desc, vn_desc, k_s, v_s, a_s, w_s, u_s,
                            h_s, vo_s, ld_ready, wu_ready, wu_free, G, h0, v_new, doc_offsets,
                            doc_chunk_offsets, i_n, i_hv, HV, tk, tv, i_hv * BT, K, V, BT,
                            STAGES, USE_H0)),
        (_form_partition, (k_s, v_s, a_s, w_s, u_s, ld_ready, wu_ready, wu_free, w_desc, G,
                           beta, W, doc_offsets, i_n, i_hv, HV, i_hv * K, K, BT, STAGES)),
    ], [4], [F_REGS])


_RECOMPUTE_GLUON_KERNEL = cached_launch(_recompute_gluon_kernel)


def gluon_recompute_supported(k: torch.Tensor, v: torch.Tensor, A_inv: torch.Tensor,
                              index: ChunkIndex) -> bool:
    """Whether :func:`chunk_recompute_gluon` serves these shapes and dtypes (the device is
    not checked): K = V = 128, chunks of 64, k, v and the inverse of one 16-bit dtype."""
    return (k.dim() == 3 and v.dim() == 3 and k.shape[-1] == _K and v.shape[-1] == _V
            and index.chunk_size == _BT and k.dtype in (torch.bfloat16, torch.float16)
            and v.dtype == k.dtype and A_inv.dtype == k.dtype)


def _descriptors(k, v, A_inv, W, h, v_new) -> dict:
    """TMA descriptors (CPU tensors suffice, for :mod:`tools.sm90_report`): k of
    ``[T, H·128]``, v, W, v_new of ``[T, HV·128]`` in ``[64, 128]`` tiles, the inverse of
    ``[T, HV·64]`` in ``[64, 64]`` tiles, h of ``[NT·HV·128, 128]`` in ``[128, 128]`` tiles."""
    return dict(k_desc=descriptor(k, [_BT, _K]),
                v_desc=descriptor(v, [_BT, _V]),
                a_desc=descriptor(A_inv, [_BT, _BT]),
                w_desc=descriptor(W, [_BT, _K]),
                h_desc=descriptor(h.view(-1, h.shape[-1]), [_K, _V]),
                vn_desc=descriptor(v_new, [_BT, _V]))


@launcher(uses_atomics=False, kernels=(_recompute_gluon_kernel,))
def chunk_recompute_gluon(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    A_inv: torch.Tensor,
    index: ChunkIndex,
    group: int,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W``, every chunk state ``h`` and ``v_new`` in one launch (stage ``recompute``):
    what :func:`gdn_core.ops.wy.wy_apply` followed by
    :func:`gdn_core.ops.chunk_state.chunk_state_fwd` (``store_states=True``) give, without
    ``U`` in memory.

    Args:
        k: ``[T, H, 128]`` bf16 or fp16; head ``hv // group`` serves value head ``hv``.
        v: ``[T, HV, 128]`` in k's dtype (a view with a row stride of its own is read in
            place).
        beta: ``[T, HV]`` write strengths (any float dtype; read as fp32).
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (another float dtype is cast).
        A_inv: ``[T, HV, 64]`` the forward's 16-bit inverse, in k's dtype.
        index: the chunk table (chunks of 64 tokens).
        group: value heads per key head.
        initial_state: ``[N, HV, 128, 128]`` each document's entry state (read as fp32)
            or ``None`` (zeros).

    Returns:
        ``(W [T, HV, 128], h [NT, HV, 128, 128], v_new [T, HV, 128])`` in k's dtype; meant
        to be bitwise the two Triton launches' (checked on the GPU).

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks not of 64, inputs not
            of one 16-bit dtype, a bad ``initial_state`` shape, or more rows than TMA's
            int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    check_wy_inputs(k, v, beta, G, index, group)
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    N, NT = index.num_docs, index.num_chunks
    if tuple(A_inv.shape) != (T, HV, _BT):
        raise ValueError(f"A_inv must be [T, HV, {_BT}] = {(T, HV, _BT)}, "
                         f"got {tuple(A_inv.shape)}")
    if not gluon_recompute_supported(k, v, A_inv, index):
        raise ValueError(f"the Gluon recompute takes k, v and A_inv in one 16-bit dtype, got "
                         f"{k.dtype}, {v.dtype}, {A_inv.dtype}")
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, "
                         f"got {tuple(initial_state.shape)}")
    if max(T, NT * HV * K) >= 2**31:
        raise ValueError(f"T={T} ({NT} chunks) exceeds TMA's int32 coordinates")
    require_sm90(k.device, "the Gluon recompute")
    dev = k.device
    W = torch.empty(T, HV, K, dtype=k.dtype, device=dev)
    h = torch.empty(NT, HV, K, V, dtype=k.dtype, device=dev)
    v_new = torch.empty(T, HV, V, dtype=k.dtype, device=dev)
    if N == 0 or HV == 0 or T == 0:
        return W, h, v_new
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    order = ordered_docs(index)
    _RECOMPUTE_GLUON_KERNEL[(HV, N)](
        *_descriptors(k, v, A_inv, W, h, v_new).values(), G, beta.contiguous(),
        initial_state, W, v_new, index.doc_offsets, index.doc_chunk_offsets,
        index.doc_chunk_offsets if order is None else order, HV, GROUP=group, K=K, V=V,
        BT=_BT, STAGES=GLUON_RECOMPUTE_STAGES, USE_H0=initial_state is not None,
        F_REGS=GLUON_RECOMPUTE_F_REGS, ORDERED=order is not None, num_warps=8,
        maxnreg=_MAXNREG,
    )
    return W, h, v_new
