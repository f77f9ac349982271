"""Backward stage (a), the chunk-local part of ``dV'``, in Gluon for Hopper (sm_90a):
opt-in, K = V = 128, chunks of 64, 16-bit inputs.

Same math, arguments and result as :func:`gdn_core.ops.dv_local.dv_local_bwd`::

    dV'_local = scale · (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j])ᵀ dO

per chunk and value head ``hv`` (q/k head ``hv // group``), but one CTA (one
warpgroup, 4 warps) per (chunk, value head) computes all 128 value columns (the
Triton kernel sweeps two 64-wide value blocks and forms ``Pᵀ`` from 64-wide K blocks).

Structure of the kernel:

1. Three TMA loads into shared memory on two mbarriers: K and Q (``[64, 128]`` tiles
   of the ``[T, H·K]`` views at ``(bos, head·K)``) on the first, dO (``[64, 128]`` of
   ``[T, HV·V]``) on the second, so the score MMA starts when K and Q have landed.
2. ``Pᵀ = K Qᵀ`` (``warpgroup_mma`` 64×64, K = 128; Qᵀ is Q's shared tile permuted, no
   copy: row ``j`` is a key, column ``i`` a query), fp32 accumulator in registers.
3. ``Pᵀ[j, i] ← scale · Pᵀ[j, i] · exp(G_i − G_j)`` where ``i ≥ j`` and ``i, j < n``,
   else 0 (the exponent is masked before ``exp`` and the product selected, not
   multiplied, so nothing overflows and a non-finite score outside the mask is
   dropped), in the accumulator layout; cast to the input dtype and converted to the
   wgmma A-operand register layout.
4. ``dV' = Pᵀ dO`` (``warpgroup_mma`` with ``Pᵀ`` from registers, dO from shared memory,
   K = 64; dO rows ``≥ n`` zeroed in shared memory first in a short chunk), cast and
   stored: a full chunk through shared memory (dO's tile, spent) and a TMA store; a
   short chunk with a row-masked register store (rows ``≥ n`` belong to the next
   document and are never written).

Layouts: as :mod:`gdn_core.ops.gluon.output` — NVMMA shared tiles (128-byte swizzle,
what TMA writes and wgmma reads), ``NVMMADistributedLayout([3, 0])`` accumulators with
instruction shapes ``[16, 64, 16]`` (``Pᵀ``) and ``[16, 128, 16]`` (dV'), ``Pᵀ`` as
``DotOperandLayout(0, parent = dV' layout, k_width = 2)`` (no shared round trip), and a
``BlockedLayout`` of 8 contiguous 16-bit values a thread for the masked store. 48 KB of
shared memory: four CTAs fit an SM.

Short chunks and document boundaries. TMA reads the full 64-row tile, so for the last
chunk of a document (``n < 64``) rows ``≥ n`` of K, Q and dO are the next document's rows
(or zeros past ``T``: the descriptors' bound is ``T``). They never reach the result:
the entries of ``Pᵀ`` they touch (row or column ``≥ n``) are replaced by 0 (a select,
so NaN and Inf there are dropped too), dO's rows ``≥ n`` are set to zero in shared
memory before ``Pᵀ dO`` (else ``0 · NaN`` would carry a non-finite value of the next
document in), and no row ``≥ n`` is stored. G is loaded with the row mask.

Determinism: no atomics; each output tile is written by one CTA and the wgmma K loops
have a fixed order, so two calls give the same bits. Not bitwise equal to the Triton
kernel (its K reduction runs in two 64-wide blocks).

Compiled for sm_90a with Triton 3.6 on a machine without a GPU, not yet run on one
(``PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/sm90_report.py gluon_dv_local``;
bf16, K = V = 128, H = HV = 16 and H = 8, HV = 16 alike; per CTA 8 ``m64n64k16`` and 4
``m64n128k16`` wgmma, three TMA loads, one TMA store)::

    4 warps, TMA store, maxnreg 128 (the launcher's): 128 registers, 0 spills,
                                      49,168 B shared, 1,184 SASS instructions (4 CTAs/SM)
    4 warps, TMA store, uncapped:     136 registers, 0 spills, 1,176 SASS (3 CTAs/SM)
    4 warps, register stores, 128:    128 registers, 0 spills, 1,096 / 1,104 SASS
    4 warps, register stores, uncapped: 142 registers, 0 spills, 1,080 / 1,088 SASS
    8 warps, TMA store:                76 registers, 0 spills,   752 SASS

against the Triton ``_dv_local_kernel`` (BK = BV = 64, 4 warps): 1 stage (pinned) 111 /
112 registers, 0 spills, 16,384 B shared, 920 / 912 SASS; 3 stages 120 / 126 registers,
49,152 B shared, 1,104 / 1,120 SASS.

What only the GPU can tell: whether 4 CTAs an SM (the 128-register cap) beat 3, whether
the TMA store beats the 16-byte register stores, and whether one chunk a CTA (no
prefetch of the next chunk) hides the load latency of this memory-bound stage.
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
    "GLUON_DV_LOCAL_MAXNREG",
    "GLUON_DV_LOCAL_TMA_STORE",
    "GLUON_DV_LOCAL_WARPS",
    "dv_local_bwd_gluon",
    "gluon_dv_local_supported",
]


#: Warps of the kernel (4: one warpgroup; 8, two warpgroups splitting the columns, is
#: for the probe).
GLUON_DV_LOCAL_WARPS = 4
#: Full chunks stored by TMA from shared memory (else every chunk by register stores).
GLUON_DV_LOCAL_TMA_STORE = True
#: Register cap of the 4-warp kernel (``None``: ptxas's choice, 136): at 128, four CTAs
#: fit an SM (registers 4 × 128 × 128 ≤ 64 K; shared 4 × 48 KB), at 136 three.
GLUON_DV_LOCAL_MAXNREG: int | None = 128
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _dv_local_gluon_kernel(
    q_desc,
    k_desc,
    do_desc,
    dv_desc,
    G,
    dv,
    chunk_start,
    chunk_len,
    scale,
    HV,
    GROUP: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    TMA_STORE: gl.constexpr,
):
    i_c = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_h = i_hv // GROUP
    bos = gl.load(chunk_start + i_c)
    n = gl.load(chunk_len + i_c)
    dtype: gl.constexpr = q_desc.dtype
    # 4 warps: one warpgroup, all columns; 8: two warpgroups, each half the columns
    WG: gl.constexpr = gl.num_warps() // 4

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BT // WG, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, V // WG, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4 * WG, 1],
        order=[1, 0])

    # --- TMA loads: K, Q | dO on two barriers
    k_s = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)
    q_s = gl.allocate_shared_memory(dtype, [BT, K], q_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [BT, V], do_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(bars.index(0), 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [bos, i_h * K], bars.index(0), k_s)
    tma.async_copy_global_to_shared(q_desc, [bos, i_h * K], bars.index(0), q_s)
    mbarrier.expect(bars.index(1), do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [bos, i_hv * V], bars.index(1), do_s)

    # --- G of the chunk's rows (masked: rows >= n read 0), while the copies fly;
    # rows of Pᵀ are keys j, columns queries i
    rj = gl.arange(0, BT, layout=gl.SliceLayout(1, s_layout))
    ci = gl.arange(0, BT, layout=gl.SliceLayout(0, s_layout))
    p_g = G + (bos.to(gl.int64) * HV + i_hv)
    g_j = gl.load(p_g + rj * HV, mask=rj < n, other=0.0)
    g_i = gl.load(p_g + ci * HV, mask=ci < n, other=0.0)

    # --- Pᵀ = K Qᵀ
    mbarrier.wait(bars.index(0), 0)
    s_acc = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, s_layout),
                          use_acc=False, is_async=True)

    # --- dO rows >= n zeroed in a short chunk (while the score MMA runs)
    mbarrier.wait(bars.index(1), 0)
    if n < BT:
        vr = gl.arange(0, BT, layout=gl.SliceLayout(1, io_layout))
        vt = do_s.load(io_layout)
        do_s.store(gl.where((vr < n)[:, None], vt, gl.zeros_like(vt)))
        fence_async_shared()
        gl.thread_barrier()

    s_acc = warpgroup_mma_wait(0, deps=[s_acc, k_s, q_s])[0]

    # --- Pᵀ[j, i] = scale · S · exp(G_i − G_j) on i >= j, i, j < n (exponent masked)
    causal = (ci[None, :] >= rj[:, None]) & (ci[None, :] < n)
    decay = gl.exp(gl.where(causal, g_i[None, :] - g_j[:, None], 0.0))
    p = gl.where(causal, s_acc * decay * scale, 0.0)
    p = gl.convert_layout(p.to(dtype), p_layout)

    # --- dV' = Pᵀ dO
    acc = warpgroup_mma(p, do_s, gl.zeros([BT, V], gl.float32, a_layout), use_acc=False,
                        is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc, do_s])[0]
    out = acc.to(dtype)

    for i in gl.static_range(2):
        mbarrier.invalidate(bars.index(i))

    # --- store rows < n only: a full chunk by TMA from dO's (spent) tile
    if TMA_STORE:
        if n == BT:
            gl.thread_barrier()  # every warpgroup's MMA has finished reading do_s
            do_s.store(out)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dv_desc, [bos, i_hv * V], do_s)
            tma.store_wait(0)
        else:
            _store_rows(dv, out, bos, n, i_hv, HV, V, BT, io_layout)
    else:
        _store_rows(dv, out, bos, n, i_hv, HV, V, BT, io_layout)


_DV_LOCAL_GLUON_KERNEL = cached_launch(_dv_local_gluon_kernel)


@gluon.jit
def _store_rows(dv, out, bos, n, i_hv, HV, V: gl.constexpr, BT: gl.constexpr,
                io_layout: gl.constexpr):
    """Rows ``< n`` of the ``[BT, V]`` tile ``out`` to ``dv[bos + row, i_hv, :]``."""
    res = gl.convert_layout(out, io_layout)
    orow = gl.arange(0, BT, layout=gl.SliceLayout(1, io_layout))
    ocol = gl.arange(0, V, layout=gl.SliceLayout(0, io_layout))
    p_o = dv + (bos.to(gl.int64) * HV + i_hv) * V
    offs = orow[:, None] * (HV * V) + ocol[None, :]
    mask = (orow[:, None] < n) & (ocol[None, :] < V)
    gl.store(p_o + offs, res, mask=mask)


def gluon_dv_local_supported(q: torch.Tensor, do: torch.Tensor, index: ChunkIndex) -> bool:
    """Whether :func:`dv_local_bwd_gluon` serves these shapes and dtypes (the device is not
    checked, nor ``k``, ``G`` or ``out``): K = V = 128, chunks of 64, q and do of one
    16-bit dtype."""
    return (q.shape[-1] == _K and do.shape[-1] == _V and index.chunk_size == _BT
            and q.dtype in (torch.bfloat16, torch.float16) and do.dtype == q.dtype)


def _require_gluon_sm90(device: torch.device) -> None:
    require_sm90(device, "the Gluon dv_local kernel")


def _descriptors(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, dv: torch.Tensor) -> dict:
    """TMA descriptors of the kernel: ``[64, 128]`` tiles of ``q, k [T, H·K]`` and of
    ``do, dv [T, HV·V]`` (``dv`` contiguous: it is the result buffer)."""
    return dict(q_desc=descriptor(q, [_BT, _K]),
                k_desc=descriptor(k, [_BT, _K]),
                do_desc=descriptor(do, [_BT, _V]),
                dv_desc=descriptor(dv.view(dv.shape[0], -1), [_BT, _V]))


@launcher(uses_atomics=False, kernels=(_dv_local_gluon_kernel,))
def dv_local_bwd_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    G: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunk-local ``dV'`` of every chunk by the Gluon kernel (opt-in; the Triton kernel
    is the default).

    Args:
        q, k: ``[T, H, 128]`` bf16 or fp16 (row-strided views are read in place); head
            ``hv // group`` serves value head ``hv``.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (another float dtype is cast).
        do: ``[T, HV, 128]`` in q's dtype, the output gradient.
        scale: the output scale.
        index: the chunk table (chunks of 64 tokens).
        group: value heads per key head.
        out: optional result buffer, a contiguous 16-byte aligned ``[T, HV, 128]`` tensor
            in q's dtype.

    Returns:
        ``dv_local: [T, HV, 128]`` in q's dtype (``out`` when given).

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks not of 64, q, k, do
            not one 16-bit dtype, an ``out`` that is not such a buffer, or more rows than
            TMA's int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    T, H, K = q.shape
    HV, V = do.shape[1], do.shape[2]
    NT = index.num_chunks
    if (
        tuple(k.shape) != (T, H, K)
        or do.shape[0] != T
        or HV != H * group
        or tuple(G.shape) != (T, HV)
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, G {tuple(G.shape)}, "
            f"do {tuple(do.shape)}, group {group}, tokens {index.total_tokens}"
        )
    if (K, V) != (_K, _V) or index.chunk_size != _BT:
        raise ValueError(f"the Gluon dv_local kernel serves K = V = {_K} and chunks of {_BT}, "
                         f"got K={K}, V={V}, chunk size {index.chunk_size}")
    if q.dtype not in (torch.bfloat16, torch.float16) or any(x.dtype != q.dtype for x in (k, do)):
        raise ValueError(f"the Gluon dv_local kernel takes q, k, do in one 16-bit dtype, got "
                         f"{q.dtype}, {k.dtype}, {do.dtype}")
    if out is not None and (tuple(out.shape) != (T, HV, V) or out.dtype != q.dtype
                            or not out.is_contiguous() or out.data_ptr() % 16 != 0):
        raise ValueError(f"out must be a contiguous, 16-byte aligned {q.dtype} {(T, HV, V)}, "
                         f"got {out.dtype} {tuple(out.shape)} "
                         f"(contiguous={out.is_contiguous()})")
    if T >= 2**31:
        raise ValueError(f"T={T} exceeds TMA's int32 coordinates")
    _require_gluon_sm90(q.device)
    if out is None:
        out = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    if NT == 0 or HV == 0 or T == 0:
        return out
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    d = _descriptors(q, k, do, out)
    warps = GLUON_DV_LOCAL_WARPS
    constexprs = dict(GROUP=group, K=K, V=V, BT=_BT, TMA_STORE=GLUON_DV_LOCAL_TMA_STORE,
                      num_warps=warps)
    if warps == 4 and GLUON_DV_LOCAL_MAXNREG:
        constexprs["maxnreg"] = GLUON_DV_LOCAL_MAXNREG
    _DV_LOCAL_GLUON_KERNEL[(NT, HV)](
        d["q_desc"], d["k_desc"], d["do_desc"], d["dv_desc"], G, out, index.chunk_start,
        index.chunk_len, float(scale), HV, **constexprs,
    )
    return out
