"""The forward's last phase with ``W`` and ``U`` formed on chip, warp-specialised in Gluon for
Hopper (sm_90a): stage ``fused_fwd_formed`` (by name only until the GPU has timed it),
K = V = 128, chunks of 64, 16-bit inputs.

:mod:`gdn_core.ops.gluon.fused_fwd` reads ``W`` and ``U`` (``[T, HV, 128]`` each), which the
WY forward wrote for it alone where no segment summary reads them. This kernel reads ``v``
and the WY forward's 16-bit inverse instead and forms them where the chain uses them,
with the backward recompute's statements (:func:`gdn_core.ops.gluon.recompute._form_wu`:
``W = A_inv16 · round(K ⊙ β e^G)``, ``U = A_inv16 · round(V ⊙ β)``, the bits the WY forward
writes with ``A_inv_for_backward``). Per chunk it reads q, k, v and ``A_inv`` (56 KiB)
where the fused forward reads q, k, W and U (64 KiB), and the WY forward writes only the
inverse (no 2 × 32 KiB of W and U a chunk). The chain and the output are the fused
forward's statements (its helpers), so ``o`` and the final states are meant to be bitwise
its own on W and U from :func:`~gdn_core.ops.gluon.wy.wy_fwd_gluon`
(``tests/test_gluon_fused_fwd_formed_gpu.py``).

One CTA per (document, value head) with all 128 value columns, two partitions:

* **S** (default, 8 warps): the chain of the fused forward — ``h_c`` published, ``P = W
  h_c``, ``V'``, ``vo`` published, ``vd`` over the spent U tile, ``S ← e^{G_last} S + Kᵀ vd``
  — and every TMA load. At the start of chunk ``c`` (once O has released chunk
  ``c − 1``) it issues ``q`` of chunk ``c + 1`` and ``k``, ``v`` of chunk ``c + 2``; once
  chunk ``c``'s W and U are formed, ``A_inv`` of chunk ``c + 2``.
* **O** (worker, 4 warps), per chunk ``c``: ``A = (Q Kᵀ) ⊙ decay`` rounded (q and k are
  loaded a chunk ahead), then chunk ``c + 1``'s ``W`` and ``U`` (its k, v and ``A_inv``
  loaded a chunk ahead of that: F's work done a whole chain step before S needs it), then
  ``Q h_c`` and ``round(A) vo`` once S has published them, and the output's masked store.
  Forming between the two halves of the output keeps one ``[64, 128]`` accumulator live at
  a time (O's 152 registers); the formation of chunk 0 comes before the loop.

**Tiles and their lives.** ``k`` and ``v`` of chunk ``c`` are read from O's formation in
chunk ``c − 1`` to S's update of chunk ``c``, so they sit in a 3-stage ring (``U`` is
formed over the ``v`` tile and ``vd`` over ``U``); ``q`` (O's output) and ``A_inv`` (the
formation) live one chain step and sit in 2-stage rings, as does the formed ``W``. A
document's short last chunk (``n < 64``): its tiles hold the next document's rows; the
formation selects those rows of its operands to 0, O zeroes K's rows ``≥ n`` after forming
(before S's update or O's ``Q Kᵀ`` reads them), ``V'``'s rows ``≥ n`` are selected to 0,
``A``'s rows and columns ``≥ n`` are selected away, and O stores rows ``< n`` only.

**Hand-offs** (mbarriers): ``ld_q[2]``, ``ld_kv[3]``, ``ld_a[2]`` (S's expect-tx; O waits,
S waits ``ld_kv`` too), ``wu_ready[2]`` (O → S: the chunk's W and U formed, its K rows
zeroed), ``h_ready``, ``vo_ready`` (S → O), ``o_free`` (O → S: chunk ``c``'s q, k, ``h_c``
and ``vo`` are read). A W stage is formed again only after O has waited for the ``vo`` of
the chunk that last used it (so S's ``P`` has read it). Every arrival follows
``fence_async_shared`` and the partition's ``thread_barrier``.

Shared memory (bf16): q 2 × 16 KiB, k and v 3 × 16 each, ``A_inv`` 2 × 8, W 2 × 16,
``h_c`` 32, ``vo`` 16: 224 KiB of the 227 an SM gives, so the output is stored from
registers (rows < n, 4-byte stores), not through a staging tile. Determinism: no atomics,
one CTA owns each output, every reduction in a fixed order.

Compiled for sm_90a with Triton 3.6 (``PYTHONPATH=/tmp/t36:packages/gdn-core/src python
tools/sm90_report.py gluon_fused_fwd_formed``, bf16, group 1 and 2 alike)::

    setmaxnreg S 176 / O 152 (12 warps at maxnreg 168), 104 B of spills (all in O: 64-bit
    addresses, reloaded in the loop; O at 160 spills 80, at 168 more), 229,788 B shared,
    4,112 SASS, 55 bar.sync, 48 wgmma

Not yet run on a GPU (session 33: written and compiled, the device refused the next call)
and not yet routed: :func:`gdn_core.segment.segment_fwd_finish` still calls the fused
forward. The route, once the GPU test passes and a probe times it: where no segment summary
reads W and U (``not any(layout.need_E)``), the WY forward with ``output_WU=False`` and this
kernel in place of the fused forward.
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex, ordered_docs
from gdn_core.ops.gluon.fused_fwd import (
    _causal_scores,
    _chain_update,
    _chain_values,
    _output_products,
    _store_rows_below,
    _zero_rows_from,
    forward_outputs,
)
from gdn_core.ops.gluon.fused_state_bwd import _doc_program, _doc_span
from gdn_core.ops.gluon.lang import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
)
from gdn_core.ops.gluon.recompute import _beta_and_gate, _form_wu
from gdn_core.ops.gluon.tma import descriptor
from gdn_core.ops.gluon.wy import check_wy_inputs
from gdn_core.ops.launch import cached_launch
from gdn_core.ops.registry import launcher

__all__ = ["GLUON_FORMED_O_REGS", "chunk_fwd_formed_gluon", "gluon_fused_fwd_formed_supported"]

#: registers of partition O (4 warps); S (8 warps) gets ``(3 · 168 − O) / 2``
GLUON_FORMED_O_REGS = 152
_MAXNREG = 168  # 12 warps · 32 threads · 168 ≤ 64 K
_BT, _K, _V = 64, 128, 128
_KV_STAGES, _STAGES = 3, 2  # the k/v ring; the q, A_inv and W rings


@gluon.jit
def _load(desc, bar, tile, t0, col):
    """One TMA load of a ``desc`` block at ``(t0, col)`` into ``tile``, on ``bar``."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [t0, col], bar, tile)


@gluon.jit
def _load_kv(k_desc, v_desc, bar, k_t, v_t, t0, tk, tv):
    """The k and v tiles of one chunk, on one mbarrier."""
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [t0, tk], bar, k_t)
    tma.async_copy_global_to_shared(v_desc, [t0, tv], bar, v_t)


@gluon.jit
def _chain_partition(q_desc, k_desc, v_desc, a_desc, q_s, k_s, v_s, a_s, w_s, h_s, vo_s,
                     ld_q, ld_kv, ld_a, wu_ready, h_ready, vo_ready, o_free, G, h0, ht,
                     doc_offsets, i_n, i_hv, HV, tk, tv, ta, K: gl.constexpr,
                     V: gl.constexpr, BT: gl.constexpr, USE_H0: gl.constexpr,
                     STORE_FINAL: gl.constexpr):
    """S (default, 8 warps): the loads and the recurrence; ``h_c`` and ``vo`` published."""
    gl.static_assert(gl.num_warps() == 8)
    dtype: gl.constexpr = q_s.dtype
    KVS: gl.constexpr = k_s.shape[0]
    NS: gl.constexpr = q_s.shape[0]
    # S [K, V]: the two warpgroups own 64 rows each; P, V' [BT, V]: each 64 columns
    SL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, V, 16])
    PL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, V // 2, 16])
    RP: gl.constexpr = gl.SliceLayout(1, PL)
    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)

    if n_chunks > 0:
        _load(q_desc, ld_q.index(0), q_s.index(0), bos, tk)
    for j in gl.static_range(2):  # k, v, A_inv two chunks ahead of the chain
        if j < n_chunks:
            _load_kv(k_desc, v_desc, ld_kv.index(j), k_s.index(j), v_s.index(j), bos + j * BT,
                     tk, tv)
            _load(a_desc, ld_a.index(j), a_s.index(j), bos + j * BT, ta)

    rk = gl.arange(0, K, layout=gl.SliceLayout(1, SL))
    cv = gl.arange(0, V, layout=gl.SliceLayout(0, SL))
    st_base = (i_n * HV + i_hv).to(gl.int64) * (K * V)
    if USE_H0:
        S = gl.load(h0 + st_base + rk[:, None] * V + cv[None, :])
    else:
        S = gl.zeros([K, V], gl.float32, SL)
    rows = gl.arange(0, BT, layout=RP)
    zp = gl.zeros([BT, V], gl.float32, PL)

    for c in range(0, n_chunks):
        t0 = bos + c * BT
        n = gl.minimum(eos - t0, BT)
        p_g = G + (t0.to(gl.int64) * HV + i_hv)
        g = gl.load(p_g + rows * HV, mask=rows < n, other=0.0)
        g_last = gl.load(p_g + (n - 1) * HV)
        if c > 0:  # O is done with chunk c-1: h_s, vo_s, its q and its k/v stage are free
            mbarrier.wait(o_free, (c - 1) & 1)
        if c + 1 < n_chunks:
            sq = (c + 1) % NS
            _load(q_desc, ld_q.index(sq), q_s.index(sq), t0 + BT, tk)
        if c + 2 < n_chunks:  # into chunk c-1's k/v stage
            skv = (c + 2) % KVS
            _load_kv(k_desc, v_desc, ld_kv.index(skv), k_s.index(skv), v_s.index(skv),
                     t0 + 2 * BT, tk, tv)
        # h_c = round(S): W's operand here, Q's in O
        h_s.store(S.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(h_ready, count=1)
        s = c % NS
        skv = c % KVS
        mbarrier.wait(ld_kv.index(skv), (c // KVS) & 1)
        mbarrier.wait(wu_ready.index(s), (c // NS) & 1)  # W, U formed; short K rows zeroed
        if c + 2 < n_chunks:  # the formation has read this stage's A_inv
            _load(a_desc, ld_a.index(s), a_s.index(s), t0 + 2 * BT, ta)
        S, _ = _chain_values(w_s.index(s), h_s, v_s.index(skv), vo_s, S, g, g_last, rows, n,
                             zp, PL)
        mbarrier.arrive(vo_ready, count=1)
        S = _chain_update(k_s.index(skv), v_s.index(skv), S)

    if STORE_FINAL:
        zero = gl.load(doc_offsets + i_n + 1) - eos  # offsets formed anew (not kept live)
        gl.store(ht + st_base + (rk + zero)[:, None] * V + cv[None, :], S)


@gluon.jit
def _form_chunk(k_s, v_s, a_s, w_s, ld_kv, ld_a, wu_ready, G, beta, j, bos, eos, i_hv, HV,
                rio, IO: gl.constexpr, WL: gl.constexpr):
    """O's formation of chunk ``j``: its ``W`` into W stage ``j % 2``, its ``U`` over its
    ``v`` tile, a short chunk's K rows ``≥ n`` zeroed; ``wu_ready`` arrived."""
    KVS: gl.constexpr = k_s.shape[0]
    NS: gl.constexpr = w_s.shape[0]
    BT: gl.constexpr = w_s.shape[1]
    K: gl.constexpr = w_s.shape[2]
    t0 = bos + j * BT
    n = gl.minimum(eos - t0, BT)
    b, g = _beta_and_gate(beta, G, t0, i_hv, HV, rio, n)
    skv = j % KVS
    s = j % NS
    mbarrier.wait(ld_kv.index(skv), (j // KVS) & 1)
    mbarrier.wait(ld_a.index(s), (j // NS) & 1)
    _form_wu(k_s.index(skv), v_s.index(skv), a_s.index(s), w_s.index(s), v_s.index(skv), b, g,
             rio, n, gl.zeros([BT, K], gl.float32, WL), IO)
    if n < BT:  # K's foreign rows to 0 before S's update or O's Q Kᵀ reads them
        _zero_rows_from(k_s.index(skv), n, rio, IO)
        fence_async_shared()
        gl.thread_barrier()
    mbarrier.arrive(wu_ready.index(s), count=1)


@gluon.jit
def _form_output_partition(q_s, k_s, v_s, a_s, w_s, h_s, vo_s, ld_q, ld_kv, ld_a, wu_ready,
                           h_ready, vo_ready, o_free, G, beta, o, doc_offsets, i_n, i_hv, HV,
                           scale, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr):
    """O (worker, 4 warps): chunk ``c + 1``'s W and U between chunk ``c``'s two output
    halves; the output stored from registers."""
    dtype: gl.constexpr = q_s.dtype
    KVS: gl.constexpr = k_s.shape[0]
    NS: gl.constexpr = q_s.shape[0]
    AL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    OL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
    A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=OL, k_width=2)
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1], order=[1, 0])
    RIO: gl.constexpr = gl.SliceLayout(1, IO)
    bos, eos, n_chunks = _doc_span(doc_offsets, i_n, BT)
    ri = gl.arange(0, BT, layout=gl.SliceLayout(1, AL))
    cj = gl.arange(0, BT, layout=gl.SliceLayout(0, AL))
    ro = gl.arange(0, BT, layout=gl.SliceLayout(1, OL))
    co = gl.arange(0, V, layout=gl.SliceLayout(0, OL))
    rio = gl.arange(0, BT, layout=RIO)
    tv = i_hv * V
    if n_chunks > 0:
        _form_chunk(k_s, v_s, a_s, w_s, ld_kv, ld_a, wu_ready, G, beta, 0, bos, eos, i_hv,
                    HV, rio, IO, OL)
    for c in range(0, n_chunks):
        t0 = bos + c * BT
        n = gl.minimum(eos - t0, BT)
        g1 = gl.load(G + (t0.to(gl.int64) * HV + i_hv) + rio * HV, mask=rio < n, other=0.0)
        s = c % NS
        skv = c % KVS
        mbarrier.wait(ld_q.index(s), (c // NS) & 1)
        # K's rows >= n were zeroed by this partition's formation of chunk c
        a16 = gl.convert_layout(
            _causal_scores(q_s.index(s), k_s.index(skv), g1, n, ri, cj, AL).to(dtype), A16)
        if c + 1 < n_chunks:  # chunk c-1's vo was awaited: S's P has read W stage (c+1) % 2
            _form_chunk(k_s, v_s, a_s, w_s, ld_kv, ld_a, wu_ready, G, beta, c + 1, bos, eos,
                        i_hv, HV, rio, IO, OL)
        mbarrier.wait(h_ready, c & 1)
        acc = _output_products(q_s.index(s), h_s, a16, vo_s, vo_ready, c & 1, g1, A16, OL)
        gl.thread_barrier()  # every warp's products have read q, k, h_c and vo
        mbarrier.arrive(o_free, count=1)
        _store_rows_below(o, (acc * scale).to(dtype), t0, tv, n, HV * V, ro, co)


@gluon.jit
def _fused_fwd_formed_kernel(
    q_desc, k_desc, v_desc, a_desc, G, beta, h0, o, ht, doc_offsets, doc_order, scale, HV,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    KV_STAGES: gl.constexpr, STAGES: gl.constexpr, USE_H0: gl.constexpr,
    STORE_FINAL: gl.constexpr, O_REGS: gl.constexpr, ORDERED: gl.constexpr = False,
):
    gl.static_assert(KV_STAGES >= 3)  # a chunk's k/v live from its formation to its update
    gl.static_assert(STAGES >= 2)
    i_hv = gl.program_id(0)
    i_n = _doc_program(doc_order, ORDERED)
    i_h = i_hv // GROUP
    dtype: gl.constexpr = q_desc.dtype

    q_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [KV_STAGES, BT, K], k_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [KV_STAGES, BT, V], v_desc.layout)  # V, U, vd
    a_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BT], a_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], k_desc.layout)  # operand, W
    h_s = gl.allocate_shared_memory(dtype, [K, V], gl.NVMMASharedLayout.get_default_for(
        [K, V], dtype))
    vo_s = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)
    ld_q = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ld_kv = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    ld_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    wu_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    h_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    vo_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    o_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ld_q.index(i), count=1)
        mbarrier.init(ld_a.index(i), count=1)
        mbarrier.init(wu_ready.index(i), count=1)
    for i in gl.static_range(KV_STAGES):
        mbarrier.init(ld_kv.index(i), count=1)
    mbarrier.init(h_ready, count=1)
    mbarrier.init(vo_ready, count=1)
    mbarrier.init(o_free, count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_chain_partition, (q_desc, k_desc, v_desc, a_desc, q_s, k_s, v_s, a_s, w_s, h_s,
                            vo_s, ld_q, ld_kv, ld_a, wu_ready, h_ready, vo_ready, o_free, G,
                            h0, ht, doc_offsets, i_n, i_hv, HV, i_h * K, i_hv * V, i_hv * BT,
                            K, V, BT, USE_H0, STORE_FINAL)),
        (_form_output_partition, (q_s, k_s, v_s, a_s, w_s, h_s, vo_s, ld_q, ld_kv, ld_a,
                                  wu_ready, h_ready, vo_ready, o_free, G, beta, o,
                                  doc_offsets, i_n, i_hv, HV, scale, K, V, BT)),
    ], [4], [O_REGS])


_FUSED_FWD_FORMED_KERNEL = cached_launch(_fused_fwd_formed_kernel)


def gluon_fused_fwd_formed_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     A_inv: torch.Tensor, index: ChunkIndex) -> bool:
    """Whether :func:`chunk_fwd_formed_gluon` serves these shapes and dtypes (the device is
    not checked): K = V = 128, chunks of 64, q, k, v and the inverse of one 16-bit dtype."""
    return (k.dim() == 3 and v.dim() == 3 and k.shape[-1] == _K and v.shape[-1] == _V
            and index.chunk_size == _BT and k.dtype in (torch.bfloat16, torch.float16)
            and q.dtype == k.dtype and v.dtype == k.dtype and A_inv.dtype == k.dtype)


def _descriptors(q, k, v, A_inv) -> dict:
    """TMA descriptors (CPU tensors suffice, for :mod:`tools.sm90_report`): q, k of
    ``[T, H·128]`` and v of ``[T, HV·128]`` in ``[64, 128]`` tiles, the inverse of
    ``[T, HV·64]`` in ``[64, 64]`` tiles."""
    return dict(q_desc=descriptor(q, [_BT, _K]),
                k_desc=descriptor(k, [_BT, _K]),
                v_desc=descriptor(v, [_BT, _V]),
                a_desc=descriptor(A_inv, [_BT, _BT]))


@launcher(uses_atomics=False, kernels=(_fused_fwd_formed_kernel,))
def chunk_fwd_formed_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    A_inv: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk recurrence and output of every document with ``W`` and ``U`` formed on chip
    (stage ``fused_fwd_formed``): what :func:`~gdn_core.ops.gluon.fused_fwd.chunk_fwd_fused_gluon`
    returns on the ``W``, ``U`` that :func:`~gdn_core.ops.gluon.wy.wy_fwd_gluon` writes
    beside ``A_inv`` (``A_inv_for_backward``).

    Args:
        q, k: ``[T, H, 128]`` bf16 or fp16; head ``hv // group`` serves value head ``hv``.
        v: ``[T, HV, 128]`` in k's dtype (a view with a row stride of its own is read in
            place).
        beta: ``[T, HV]`` write strengths (any float dtype; read as fp32).
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (another float dtype is cast).
        A_inv: ``[T, HV, 64]`` the WY forward's 16-bit inverse, in k's dtype.
        scale: the output scale.
        index: the chunk table (chunks of 64 tokens).
        group: value heads per key head.
        initial_state: ``[N, HV, 128, 128]`` (read as fp32) or ``None`` (zeros).
        output_final_state: return the state after each document.

    Returns:
        ``(o [T, HV, 128] in q's dtype, final [N, HV, 128, 128] fp32 or None)``; meant to be
        bitwise the fused forward's on the WY forward's W and U (checked on the GPU).

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks not of 64, inputs not
            of one 16-bit dtype, a bad ``initial_state`` shape, or more rows than TMA's
            int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    check_wy_inputs(k, v, beta, G, index, group)
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    N = index.num_docs
    if tuple(q.shape) != tuple(k.shape):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} against k {tuple(k.shape)}")
    if tuple(A_inv.shape) != (T, HV, _BT):
        raise ValueError(f"A_inv must be [T, HV, {_BT}] = {(T, HV, _BT)}, "
                         f"got {tuple(A_inv.shape)}")
    if (K, V) != (_K, _V) or index.chunk_size != _BT:
        raise ValueError(f"the Gluon formed forward serves K = V = {_K} and chunks of {_BT}, "
                         f"got K={K}, V={V}, chunk size {index.chunk_size}")
    if not gluon_fused_fwd_formed_supported(q, k, v, A_inv, index):
        raise ValueError(f"the Gluon formed forward takes q, k, v and A_inv in one 16-bit "
                         f"dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {A_inv.dtype}")
    o, final, initial_state, launch = forward_outputs(
        q, HV, N, initial_state, output_final_state, "the Gluon formed forward")
    if not launch:
        return o, final
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    order = ordered_docs(index)
    _FUSED_FWD_FORMED_KERNEL[(HV, N)](
        *_descriptors(q, k, v, A_inv).values(), G, beta.contiguous(), initial_state, o, final,
        index.doc_offsets, index.doc_chunk_offsets if order is None else order,
        float(scale), HV, GROUP=group, K=K, V=V, BT=_BT, KV_STAGES=_KV_STAGES,
        STAGES=_STAGES, USE_H0=initial_state is not None, STORE_FINAL=output_final_state,
        O_REGS=GLUON_FORMED_O_REGS, ORDERED=order is not None, num_warps=8,
        maxnreg=_MAXNREG,
    )
    return o, final
