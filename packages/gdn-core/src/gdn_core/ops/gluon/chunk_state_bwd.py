"""Backward stage (b), the reverse state recurrence, in Gluon for Hopper (sm_90a).

Opt-in, K = V = 128, chunks of 64, 16-bit inputs. Same math, arguments and results as
:func:`gdn_core.ops.chunk_state_bwd.chunk_state_bwd` (its module docstring has the
contract: ``dh``, ``dv``, ``dh0``, ``store=False``, ``need``, the aliasing of ``dv`` with
``dv_local`` and of ``dh0`` with ``dht``); the Triton kernel stays the default and serves
every other shape. Per document, from ``dS_N = dht`` (or 0), over its chunks in reverse::

    dV'_c = dv_local_c + diag(kd) (K_c dS_{c+1}),      kd = exp(G_last − G)
    dS_c  = exp(G_last) dS_{c+1} + Q_cᵀ (diag(scale Γ) dO_c) − W_cᵀ dV'_c

**The state transposed.** One CTA per (document, value head, ``BV`` value columns)
keeps ``dSᵀ`` (``[BV, K]`` fp32) as a ``warpgroup_mma`` accumulator in registers, so the
value columns are the MMA's M dimension and every product of the chain takes its
left operand from registers (no shared-memory round trip, fence or CTA barrier on
the chain)::

    Xᵀ      = dSᵀ (bf16, registers) · K_cᵀ (shared, K's tile permuted)   [BV, 64]
    dV'ᵀ    = Xᵀ ⊙ kd (columns) + dv_localᵀ                              [BV, 64] fp32
    dS_cᵀ   = exp(G_last) dSᵀ + (scale Γ dO)ᵀ · Q_c − dV'ᵀ (bf16, registers) · W_c

(the second and third products accumulate onto one fp32 accumulator, in the Triton
kernel's order: ``exp(G_last) dS``, then the ``Q`` term, then the ``W`` term; both have
the 64 tokens as their K extent and the shared tiles of Q and W as B operands
untransposed). The ``Q`` term is issued right after ``Xᵀ`` and runs on the tensor cores
while ``dV'`` is formed: the chain per chunk is ``cvt → Xᵀ (8 k-steps) → elementwise →
cvt → W term (4 k-steps)``.

**Value blocking and bits.** ``BV`` = 64 per warpgroup (``num_warps = BV / 16``; the
launcher's ``BV = 128``, two warpgroups, each owning 64 value columns). Because V is
the M dimension, ``BV`` only changes how many 64-row warpgroup tiles there are: each
value column is computed by the same ``m64n64k16`` / ``m64n128k16`` instructions in the
same order whatever ``BV`` is, so the bits do not depend on ``BV`` (the GPU test checks
64 against 128). ``BV = 128`` reads Q, K, W once per (document, head) instead of once per
value block.

**Loads.** Per chunk the CTA reads five tiles by TMA: Q, K (``[64, 128]`` of ``[T, H·K]``),
W (``[64, 128]`` of ``[T, HV·K]``), dO and dv_local (``[64, BV]`` of ``[T, HV·V]``), into a
ring of ``STAGES`` shared-memory stages, one mbarrier each; the loads of the chunk
``STAGES`` ahead are issued as soon as a stage is released (end of each chunk), the
first ``STAGES`` before the loop. The register operands of the next chunk
(``(scale Γ dO)ᵀ`` in the A-operand layout, ``dv_localᵀ``, ``kd``, ``exp(G_last)``) are
prepared from its stage while the current chunk's ``W`` product runs; G (fp32 ``[T,
HV]``, a stride-HV column, not a TMA box) is loaded one chunk ahead with plain loads.

**Stores.** ``dh[c] = dS_{c+1}`` (input dtype) goes through a ``[K, BV]`` shared tile
(written as its transpose from the accumulator) and a TMA store; ``dV'`` likewise
through a ``[64, BV]`` tile for full chunks, and by masked stores from registers for
a document's short last chunk (a TMA store would write the next document's rows).
``dh0`` (fp32) is stored once from registers; ``dht`` is loaded first (so ``dh0`` may be
``dht``). ``dv`` may be ``dv_local``: each element of ``dV'`` is stored by the program that
read its ``dv_local``, after reading it.

**Short chunks.** Only a document's last chunk (the first processed) can be short
(``n < 64``). TMA reads its whole 64-row tiles, so rows ``≥ n`` hold the next document's
rows (zeros past ``T``; for ``dv_local`` possibly already overwritten by that document's
program when ``dv`` is ``dv_local``): they are set to zero in shared memory (``where``,
which also clears NaN) before any product, and G is loaded masked (``Γ``, ``kd`` zero
past ``n``). The result is then a function of the document's own rows only.

Determinism: no atomics, each output tile owned by one CTA, fixed reduction orders.

Compiled for sm_90a with Triton 3.6 on a machine without a GPU, not yet run on one
(``PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/sm90_report.py gluon_state_bwd``;
bf16, ``dht`` fp32, ``store=True``; H = HV = 16 and H = 8, HV = 16 alike)::

    BV=128, 8 warps, 2 stages (the launcher's): 255 registers, 0 spills, 213,008 B shared,
                                                2,920 / 2,928 SASS instructions (H=16 / 8)
    BV=64,  4 warps, 2 stages:                  255 registers, 0 spills, 155,664 B shared,
                                                3,128 SASS instructions
    BV=64,  4 warps, 3 stages:                  255 registers, 12 B spills, 221,208 B shared
    BV=128, store=False + need (segment path):  255 registers, 0 spills, 163,856 B shared

against the Triton ``_chunk_state_bwd_kernel`` at its pinned configuration (BV=32, 4 warps,
3 stages): 151 registers, 0 spills, 177,160 B shared, 1,816 SASS instructions. Per chunk a
warpgroup issues 8 ``m64n64k16`` (Xᵀ) and 2 × 4 ``m64n128k16`` (the Q and W terms) wgmma,
five TMA loads and (``store=True``) two TMA stores; the transposed shared-memory reads and
writes are ``ldmatrix.trans`` / ``stmatrix.trans``. One CTA per SM (213 KB).

What only the GPU can tell: whether two stages (one chunk of prefetch) hide the TMA
latency at one CTA per SM (``BV=64`` at three stages is the alternative the probe
times); the cost of the two CTA barriers a chunk (the staging tiles' TMA stores and
the stage release); the uncoalesced register stores of a short chunk's ``dV'``.
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

__all__ = [
    "GLUON_STATE_BWD_BV",
    "GLUON_STATE_BWD_STAGES",
    "chunk_state_bwd_gluon",
    "gluon_state_bwd_supported",
]


#: Value columns per CTA (64 per warpgroup: 128 = two warpgroups, 8 warps).
GLUON_STATE_BWD_BV = 128
#: Shared-memory stages of the TMA ring (chunks in flight ahead of the math).
GLUON_STATE_BWD_STAGES = 2
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _zero_rows(s, n, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
    """Rows ``>= n`` of the shared ``[R, C]`` tile ``s`` set to zero."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    x = s.load(layout)
    s.store(gl.where((r < n)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _issue_loads(q_desc, k_desc, w_desc, do_desc, dvl_desc, bar, q_s, k_s, w_s, do_s, dvl_s,
                 t0, tk, tw, tv):
    """The five TMA loads of one chunk into one ring stage, on its mbarrier."""
    mbarrier.expect(bar, 3 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [t0, tk], bar, k_s)
    tma.async_copy_global_to_shared(q_desc, [t0, tk], bar, q_s)
    tma.async_copy_global_to_shared(w_desc, [t0, tw], bar, w_s)
    tma.async_copy_global_to_shared(dvl_desc, [t0, tv], bar, dvl_s)
    tma.async_copy_global_to_shared(do_desc, [t0, tv], bar, do_s)


@gluon.jit
def _chunk_state_bwd_gluon_kernel(
    q_desc, k_desc, w_desc, do_desc, dvl_desc, dv_desc, dh_desc,
    G, dht, dv, dh0, doc_offsets, doc_chunk_offsets, need, scale, HV,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    BV: gl.constexpr, STAGES: gl.constexpr, USE_DHT: gl.constexpr, HAS_NEED: gl.constexpr,
    STORE: gl.constexpr,
):
    gl.static_assert(BV == 64 * (gl.num_warps() // 4))
    gl.static_assert(STAGES >= 2)
    i_v = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_n = gl.program_id(2)
    i_h = i_hv // GROUP
    if HAS_NEED:
        if gl.load(need + i_n) == 0:
            return
    dtype: gl.constexpr = q_desc.dtype
    WG: gl.constexpr = gl.num_warps() // 4

    # --- register layouts: value columns on M (64 per warpgroup), tokens / keys on N
    L64: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4 * WG, 1], instr_shape=[16, BT, 16])
    L128: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4 * WG, 1], instr_shape=[16, K, 16])
    A64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L64, k_width=2)
    A128: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L128, k_width=2)
    TOK: gl.constexpr = gl.SliceLayout(0, L64)  # a vector over the chunk's tokens
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4 * WG, 1],
        order=[1, 0])

    # --- shared memory: the ring, the store staging tiles, the barriers
    q_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], k_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], w_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BV], do_desc.layout)
    dvl_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BV], dvl_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    if STORE:
        dh_s = gl.allocate_shared_memory(dtype, [K, BV], dh_desc.layout)
        dv_s = gl.allocate_shared_memory(dtype, [BT, BV], dv_desc.layout)
    fence_async_shared()

    bos = gl.load(doc_offsets + i_n)
    eos = gl.load(doc_offsets + i_n + 1)
    c0 = gl.load(doc_chunk_offsets + i_n)
    n_chunks = gl.cdiv(eos - bos, BT)
    v0 = i_v * BV
    tk = i_h * K
    tw = i_hv * K
    tv = i_hv * V + v0

    # --- the first STAGES chunks' loads (chunk it = the document's chunk n_chunks-1-it)
    for j in gl.static_range(STAGES):
        if j < n_chunks:
            _issue_loads(q_desc, k_desc, w_desc, do_desc, dvl_desc, bars.index(j),
                         q_s.index(j), k_s.index(j), w_s.index(j), do_s.index(j),
                         dvl_s.index(j), bos + (n_chunks - 1 - j) * BT, tk, tw, tv)

    # --- dSᵀ from dht (or 0): rows = value columns v0.., columns = keys
    rv = gl.arange(0, BV, layout=gl.SliceLayout(1, L128))
    ck = gl.arange(0, K, layout=gl.SliceLayout(0, L128))
    off_state = (i_n.to(gl.int64) * HV + i_hv) * (K * V)
    off_t = ck[None, :] * V + (v0 + rv)[:, None]  # element (v, k) of the [K, V] state
    if USE_DHT:
        ds = gl.load(dht + off_state + off_t).to(gl.float32)
    else:
        ds = gl.zeros([BV, K], gl.float32, L128)

    # --- the first chunk: zero a short chunk's foreign rows, prepare its operands
    tok = gl.arange(0, BT, layout=TOK)
    rv64 = gl.arange(0, BV, layout=gl.SliceLayout(1, L64))
    L0 = gl.minimum(eos - (bos + (n_chunks - 1) * BT), BT)
    if n_chunks > 0:
        mbarrier.wait(bars.index(0), 0)
        if L0 < BT:
            _zero_rows(q_s.index(0), L0, BT, K, IO)
            _zero_rows(k_s.index(0), L0, BT, K, IO)
            _zero_rows(w_s.index(0), L0, BT, K, IO)
            _zero_rows(do_s.index(0), L0, BT, BV, IO)
            _zero_rows(dvl_s.index(0), L0, BT, BV, IO)
            fence_async_shared()
            gl.thread_barrier()
    t0 = bos + (n_chunks - 1) * BT
    p_g = G + (t0.to(gl.int64) * HV + i_hv)
    g = gl.load(p_g + tok * HV, mask=(tok < L0) & (n_chunks > 0), other=0.0)
    g_last = gl.load(p_g + (L0 - 1) * HV, mask=n_chunks > 0, other=0.0)
    dot = do_s.index(0).permute((1, 0)).load(L64).to(gl.float32)
    dos = gl.convert_layout((dot * gl.where(tok < L0, gl.exp(g) * scale, 0.0)[None, :]).to(dtype),
                            A128)

    for it in range(0, n_chunks):
        s = it % STAGES
        ic = n_chunks - 1 - it
        t0 = bos + ic * BT
        L = gl.minimum(eos - t0, BT)
        # ---- the chain: Xᵀ = dSᵀ Kᵀ, then the Q term behind it on the tensor cores
        dsb = ds.to(dtype)
        xa = gl.convert_layout(dsb, A64)
        acc = ds * gl.exp(g_last)
        x = warpgroup_mma(xa, k_s.index(s).permute((1, 0)), gl.zeros([BV, BT], gl.float32, L64),
                          use_acc=False, is_async=True)
        acc = warpgroup_mma(dos, q_s.index(s), acc, is_async=True)
        if STORE:
            dh_s.permute((1, 0)).store(dsb)  # dh[c] = dS_{c+1}
        kd = gl.where(tok < L, gl.exp(g_last - g), 0.0)
        dvlt = dvl_s.index(s).permute((1, 0)).load(L64).to(gl.float32)
        # next chunk's G (plain loads, consumed below while the W term runs)
        has_next = it + 1 < n_chunks
        p_g = G + ((t0 - BT).to(gl.int64) * HV + i_hv)
        g = gl.load(p_g + tok * HV, mask=(tok < BT) & has_next, other=0.0)
        g_last = gl.load(p_g + (BT - 1) * HV, mask=has_next, other=0.0)
        x = warpgroup_mma_wait(1, deps=[x, k_s.index(s), xa])[0]
        dvp = x * kd[None, :] + dvlt  # dV'ᵀ
        dva = gl.convert_layout((-dvp).to(dtype), A128)
        acc = warpgroup_mma_wait(0, deps=[acc, q_s.index(s), dos])[0]
        acc = warpgroup_mma(dva, w_s.index(s), acc, is_async=True)
        # ---- off the chain: this chunk's stores, the next chunk's Q-term operand
        if STORE:
            dvb = dvp.to(dtype)
            if L < BT:
                p_dv = dv + (t0.to(gl.int64) * HV + i_hv) * V + v0
                gl.store(p_dv + tok[None, :] * (HV * V) + rv64[:, None], dvb,
                         mask=(tok[None, :] < L) & (rv64[:, None] < BV))
            else:
                dv_s.permute((1, 0)).store(dvb)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dh_desc, [((c0 + ic) * HV + i_hv) * K, v0], dh_s)
            if L == BT:
                tma.async_copy_shared_to_global(dv_desc, [t0, tv], dv_s)
        sn = (it + 1) % STAGES
        mbarrier.wait(bars.index(sn), ((it + 1) // STAGES) & 1, pred=has_next)
        dot = do_s.index(sn).permute((1, 0)).load(L64).to(gl.float32)
        dos = gl.convert_layout((dot * (gl.exp(g) * scale)[None, :]).to(dtype), A128)
        ds = warpgroup_mma_wait(0, deps=[acc, w_s.index(s), dva])[0]
        # ---- release stage s (and the staging tiles), refill it with chunk it + STAGES
        if STORE:
            tma.store_wait(0)
        gl.thread_barrier()
        if it + STAGES < n_chunks:
            _issue_loads(q_desc, k_desc, w_desc, do_desc, dvl_desc, bars.index(s),
                         q_s.index(s), k_s.index(s), w_s.index(s), do_s.index(s),
                         dvl_s.index(s), t0 - STAGES * BT, tk, tw, tv)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    # dh0 = dS_0. The offsets are recomputed through a runtime zero (an opaque reload of
    # eos) so the compiler does not keep the prologue's 64 offsets live across the loop.
    zero = gl.load(doc_offsets + i_n + 1) - eos
    off_e = (ck + zero)[None, :] * V + (v0 + rv)[:, None]
    gl.store(dh0 + off_state + off_e, ds)


_CHUNK_STATE_BWD_GLUON_KERNEL = cached_launch(_chunk_state_bwd_gluon_kernel)


def gluon_state_bwd_supported(q: torch.Tensor, W: torch.Tensor, do: torch.Tensor,
                              dv_local: torch.Tensor, index: ChunkIndex) -> bool:
    """Whether :func:`chunk_state_bwd_gluon` serves these shapes and dtypes (the device is
    not checked, nor the other tensors): K = V = 128, chunks of 64, q, W, do, dv_local of
    one 16-bit dtype."""
    return (q.shape[-1] == _K and do.shape[-1] == _V and index.chunk_size == _BT
            and q.dtype in (torch.bfloat16, torch.float16)
            and all(x.dtype == q.dtype for x in (W, do, dv_local)))


def _descriptors(q, k, W, do, dv_local, dv, dh, BV: int) -> dict:
    """TMA descriptors over the 2-D views the kernel tiles (CPU tensors suffice to build
    them, for :mod:`tools.sm90_report`). ``dh: [NT, HV, K, V]`` (or any 16-bit tensor of
    ``K·V`` elements a row group when nothing is stored)."""
    K, V = q.shape[-1], do.shape[-1]
    return dict(
        q_desc=descriptor(q, [_BT, K]),
        k_desc=descriptor(k, [_BT, K]),
        w_desc=descriptor(W, [_BT, K]),
        do_desc=descriptor(do, [_BT, BV]),
        dvl_desc=descriptor(dv_local, [_BT, BV]),
        dv_desc=descriptor(dv, [_BT, BV]),
        dh_desc=descriptor(dh.reshape(-1, V), [K, BV]),
    )


def _check_buffer(name: str, buf: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if (tuple(buf.shape) != shape or buf.dtype != dtype or not buf.is_contiguous()
            or buf.data_ptr() % 16 != 0):
        raise ValueError(f"{name} must be a contiguous, 16-byte aligned {dtype} {shape}, got "
                         f"{buf.dtype} {tuple(buf.shape)} (contiguous={buf.is_contiguous()})")


def prepare_state_bwd(q, k, W, G, do, dv_local, dht, index: ChunkIndex, group: int, dh, dv, *,
                      store: bool, need, dh0, what: str):
    """The checks and buffers of a reverse-state launch (:func:`chunk_state_bwd_gluon`'s
    arguments; shared with :func:`~gdn_core.ops.gluon.fused_state_bwd.fused_state_bwd_gluon`,
    which passes ``dv_local=None``: it forms dv_local itself). ``what`` names the kernel in
    the errors. Returns ``((dh, dv, dh0), (dht contiguous, G fp32 contiguous))``, the second
    ``None`` when there is nothing to launch (the first then holds the results). Raises what
    :func:`chunk_state_bwd_gluon` documents."""
    T, H, K = k.shape
    HV, V = do.shape[1], do.shape[2]
    N, NT = index.num_docs, index.num_chunks
    if (
        tuple(q.shape) != (T, H, K)
        or HV != H * group
        or (do.shape[0] != T if dv_local is None  # (dv_local's shape implies do's rows)
            else tuple(dv_local.shape) != (T, HV, V))
        or tuple(W.shape) != (T, HV, K)
        or tuple(G.shape) != (T, HV)
        or (dht is not None and tuple(dht.shape) != (N, HV, K, V))
        or T != index.total_tokens
    ):
        dvl = "" if dv_local is None else f"dv_local {tuple(dv_local.shape)}, "
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, W {tuple(W.shape)}, "
            f"G {tuple(G.shape)}, do {tuple(do.shape)}, {dvl}"
            f"dht {None if dht is None else tuple(dht.shape)}, group {group}, docs {N}")
    if (K, V) != (_K, _V) or index.chunk_size != _BT:
        raise ValueError(f"{what} serves K = V = {_K} and chunks of "
                         f"{_BT}, got K={K}, V={V}, chunk size {index.chunk_size}")
    tiled = (q, k, W, do) + (() if dv_local is None else (dv_local,))
    if q.dtype not in (torch.bfloat16, torch.float16) or any(x.dtype != q.dtype for x in tiled):
        names = "q, k, W, do" + ("" if dv_local is None else ", dv_local")
        raise ValueError(f"{what} takes {names} in one "
                         "16-bit dtype, got " + ", ".join(str(x.dtype) for x in tiled))
    if max(T, NT * HV * K) >= 2**31:
        raise ValueError(f"T={T} / NT*HV*K={NT * HV * K} exceed TMA's int32 coordinates")
    if need is not None and (need.dtype != torch.int32 or tuple(need.shape) != (N,)):
        raise ValueError(f"need must be int32 [N={N}], got {need.dtype} {tuple(need.shape)}")
    dev = k.device
    if not store:
        dh = dv = None
    else:
        if dh is not None:
            _check_buffer("dh", dh, (NT, HV, K, V), k.dtype)
        if dv is not None:
            _check_buffer("dv", dv, (T, HV, V), k.dtype)
    if dh0 is not None:
        _check_buffer("dh0", dh0, (N, HV, K, V), torch.float32)
    require_sm90(dev, what)
    if store:
        dh = torch.empty(NT, HV, K, V, dtype=k.dtype, device=dev) if dh is None else dh
        dv = torch.empty(T, HV, V, dtype=k.dtype, device=dev) if dv is None else dv
    if dh0 is None:
        dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if N == 0 or HV == 0:
        return (dh, dv, dh0), None
    if dht is not None:
        dht = dht.contiguous()
    # dv_local is read in place when dv is dv_local (the aliasing the contract allows):
    # rows_view describes a contiguous buffer where it lies
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    if T == 0:  # every document is empty: dh0 = dht (or 0), nothing to tile
        want = slice(None) if need is None else need.to(dev) != 0
        dh0[want] = 0.0 if dht is None else dht.to(dev, torch.float32)[want]
        return (dh, dv, dh0), None
    return (dh, dv, dh0), (dht, G)


@launcher(uses_atomics=False, kernels=(_chunk_state_bwd_gluon_kernel,))
def chunk_state_bwd_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    G: torch.Tensor,
    do: torch.Tensor,
    dv_local: torch.Tensor,
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
    """Reverse state recurrence by the Gluon kernel (opt-in; the Triton kernel is the default).

    The contract of :func:`gdn_core.ops.chunk_state_bwd.chunk_state_bwd`: ``q, k:
    [T,H,128]``; ``W: [T,HV,128]``; ``G: [T,HV]`` fp32 (another float dtype is cast); ``do,
    dv_local: [T,HV,128]``; ``dht: [N,HV,128,128]`` (any float dtype) or ``None``;
    ``q, k, W, do, dv_local`` in one 16-bit dtype. ``dh``/``dv`` may supply the result
    buffers (``dv`` may be ``dv_local``), ``dh0`` that of ``dh0`` (may be ``dht``).
    ``store=False``: only ``dh0``; ``need``: int32 ``[N]``, documents with ``need == 0``
    skipped (their ``dh0`` rows unwritten).

    Returns:
        ``(dh [NT,HV,K,V], dv [T,HV,V])`` in q's dtype (``None, None`` when
        ``store=False``) and ``dh0 [N,HV,K,V]`` fp32.

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks not of 64, the tiled
            tensors not of one 16-bit dtype, a ``need``/``dh``/``dv``/``dh0`` buffer of
            another shape or dtype (or not contiguous and 16-byte aligned), or more rows
            than TMA's int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    outs, ready = prepare_state_bwd(q, k, W, G, do, dv_local, dht, index, group, dh, dv,
                                    store=store, need=need, dh0=dh0,
                                    what="the Gluon state-backward kernel")
    if ready is None:
        return outs
    (dh, dv, dh0), (dht, G) = outs, ready
    K, V, dev = k.shape[2], do.shape[2], k.device
    HV, N = do.shape[1], index.num_docs
    BV = GLUON_STATE_BWD_BV
    # descriptors the kernel never uses (STORE=False) still need a 16-bit tensor
    dummy = None if store else torch.empty(K, V, dtype=q.dtype, device=dev)
    descs = _descriptors(q, k, W, do, dv_local, dv if store else dv_local,
                         dh if store else dummy, BV)
    grid = (V // BV, HV, N)
    _CHUNK_STATE_BWD_GLUON_KERNEL[grid](
        *descs.values(), G, dht if dht is not None else dh0, dv if store else dh0, dh0,
        index.doc_offsets, index.doc_chunk_offsets,
        need if need is not None else index.doc_chunk_offsets, float(scale), HV,
        GROUP=group, K=K, V=V, BT=_BT, BV=BV, STAGES=GLUON_STATE_BWD_STAGES,
        USE_DHT=dht is not None, HAS_NEED=need is not None, STORE=store,
        num_warps=BV // 16,
    )
    return dh, dv, dh0
