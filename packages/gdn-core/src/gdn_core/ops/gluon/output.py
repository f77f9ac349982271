"""Stage 4, the chunk output, in Gluon for Hopper (sm_90a): opt-in, K = V = 128, 16-bit.

Same math, arguments and result as :func:`gdn_core.ops.output.chunk_output_fwd`::

    O = scale · ( diag(exp G) Q h_c + (Q Kᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j]) V' )

but one CTA (one warpgroup, 4 warps) per (chunk, value head) computes all 128
value columns, so ``Q Kᵀ`` is formed once (the Triton kernel runs two 64-wide
value blocks and forms it twice).

Structure of the kernel:

1. Four TMA loads into shared memory, on three mbarriers: Q and K (``[64, 128]``
   tiles of the ``[T, H·K]`` views at ``(bos, head·K)``) on the first, the state
   ``h_c`` (a ``[128, 128]`` tile of the ``[NT·HV·K, V]`` view) on the second, V'
   (``[64, 128]`` of ``[T, HV·V]``) on the third, so the first MMA starts as soon
   as Q and K have landed.
2. ``S = Q Kᵀ`` (``warpgroup_mma`` 64×64, K = 128; Kᵀ is K's shared tile permuted,
   no copy) and ``A = Q h_c`` (64×128, K = 128) issued asynchronously back to back,
   fp32 accumulators in registers.
3. ``P = S ⊙ exp(G_i − G_j)`` where ``i ≥ j`` and ``i < n``, else 0 (the exponent is
   masked before ``exp``: nothing overflows), in S's accumulator layout, cast to
   the input dtype and converted to the wgmma A-operand register layout.
4. ``A ← diag(exp G) A``, then ``A ← A + P V'`` (``warpgroup_mma`` with P from
   registers, V' from shared memory, K = 64), ``O = scale · A`` cast and stored
   with a row mask (rows ≥ n belong to the next document and are never written).

Layouts and why:

* Shared tiles: ``NVMMASharedLayout.get_default_for`` of each ``[rows, 128]``
  16-bit tile, i.e. 128-byte swizzle (a row is 256 bytes): the layout both TMA
  writes and wgmma reads without bank conflicts. K's tile is used as the B
  operand transposed (``permute``), which wgmma supports for 16-bit types.
* Accumulators: ``NVMMADistributedLayout(version [3, 0], warps [4, 1])`` with
  instruction shapes ``[16, 64, 16]`` (S) and ``[16, 128, 16]`` (A): one m64nNk16
  wgmma per 16-wide K step over the warpgroup's 64 rows.
* P: ``DotOperandLayout(0, parent = A's layout, k_width = 2)``, the register
  A operand of wgmma (no shared-memory round trip for P).
* The store: a ``BlockedLayout`` of 8 contiguous 16-bit values per thread
  (16-byte stores, 16 threads per 256-byte row).

Short chunks and document boundaries. TMA reads the full 64-row tile, so for
the last chunk of a document (``n < 64``) rows ``≥ n`` of Q, K and V' are the next
document's rows (or zeros past ``T``: the descriptors' bound is ``T``, and TMA
fills out-of-bounds rows with zeros). They never reach the result: rows ``≥ n``
of ``Q h_c`` and of P are never stored or are zeroed by the mask, columns ``≥ n``
of P are zero because ``j ≤ i < n``, and V's rows ``≥ n`` are zeroed in shared
memory before ``P V'`` (a short chunk only; else a non-finite value of the next
document would enter through ``0 · NaN``).

Determinism: no atomics, a fixed reduction order (each output tile is owned by
one CTA; the wgmma K loop is fixed), so two calls give the same bits.

Registration: declared with :func:`gdn_core.ops.registry.launcher`
(``uses_atomics=False``); the registry only stores the kernel object, so a
``GluonJITFunction`` is accepted, and ``tools/check_kernel_determinism.py`` scans
``@gluon.jit`` kernels for ``gl.atomic_*`` as it does ``@triton.jit`` ones.

Eight warps (two warpgroups) are expressed by ``num_warps = 8`` (the layouts read
``gl.num_warps()``): ``warps_per_cta [4, 2]``, each warpgroup owns half the columns
of S (32) and of A (64), and the S → P conversion then crosses warpgroups through
shared memory. The launcher pins 4 (:data:`GLUON_OUTPUT_WARPS`); 8 is for the probe.

Compiled for sm_90a with Triton 3.6 on a machine without a GPU, not yet run on one
(``PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/sm90_report.py gluon``,
bf16, group 1 and 2 alike; docs/kernels.md, "A first Gluon kernel")::

    warps=4: 171 registers, 0 spills, 81,944 B shared, 1,232 SASS instructions
    warps=8:  91 registers, 0 spills, 81,944 B shared,   824 SASS instructions
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

__all__ = ["GLUON_OUTPUT_WARPS", "chunk_output_fwd_gluon", "gluon_output_supported"]


#: Warps of the kernel (one warpgroup).
GLUON_OUTPUT_WARPS = 4
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _chunk_output_fwd_gluon_kernel(
    q_desc,
    k_desc,
    v_desc,
    h_desc,
    G,
    o,
    chunk_start,
    chunk_len,
    scale,
    HV,
    GROUP: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
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

    # --- TMA loads: Q, K | h | V' on three barriers
    q_s = gl.allocate_shared_memory(dtype, [BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)
    h_s = gl.allocate_shared_memory(dtype, [K, V], h_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(bars.index(0), 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [bos, i_h * K], bars.index(0), q_s)
    tma.async_copy_global_to_shared(k_desc, [bos, i_h * K], bars.index(0), k_s)
    mbarrier.expect(bars.index(1), h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(h_desc, [(i_c * HV + i_hv) * K, 0], bars.index(1), h_s)
    mbarrier.expect(bars.index(2), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [bos, i_hv * V], bars.index(2), v_s)

    # --- G of the chunk's rows (masked: rows >= n read 0), while the copies fly
    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BT, layout=gl.SliceLayout(0, s_layout))
    p_g = G + (bos.to(gl.int64) * HV + i_hv)
    g_r = gl.load(p_g + rows * HV, mask=rows < n, other=0.0)
    g_c = gl.load(p_g + cols * HV, mask=cols < n, other=0.0)

    # --- S = Q Kᵀ and A = Q h, both asynchronous
    mbarrier.wait(bars.index(0), 0)
    s_acc = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    mbarrier.wait(bars.index(1), 0)
    a_acc = warpgroup_mma(q_s, h_s, gl.zeros([BT, V], gl.float32, a_layout),
                          use_acc=False, is_async=True)
    s_acc = warpgroup_mma_wait(1, deps=[s_acc, k_s])[0]

    # --- P = S ⊙ exp(G_i − G_j) on i >= j, i < n (exponent masked before exp)
    causal = (rows[:, None] >= cols[None, :]) & (rows[:, None] < n)
    decay = gl.exp(gl.where(causal, g_r[:, None] - g_c[None, :], 0.0))
    p = gl.where(causal, s_acc * decay, 0.0)
    p = gl.convert_layout(p.to(dtype), p_layout)

    a_acc = warpgroup_mma_wait(0, deps=[a_acc, q_s, h_s])[0]
    g_a = gl.convert_layout(g_r, gl.SliceLayout(1, a_layout))
    a_acc = a_acc * gl.exp(g_a)[:, None]

    # --- A += P V'  (V' rows >= n zeroed first in a short chunk)
    mbarrier.wait(bars.index(2), 0)
    if n < BT:
        vr = gl.arange(0, BT, layout=gl.SliceLayout(1, io_layout))
        vt = v_s.load(io_layout)
        v_s.store(gl.where((vr < n)[:, None], vt, gl.zeros_like(vt)))
        fence_async_shared()
        gl.thread_barrier()
    a_acc = warpgroup_mma(p, v_s, a_acc, is_async=True)
    a_acc = warpgroup_mma_wait(0, deps=[a_acc, v_s])[0]

    for i in gl.static_range(3):
        mbarrier.invalidate(bars.index(i))

    # --- O = scale · A, rows < n only
    out = gl.convert_layout((a_acc * scale).to(dtype), io_layout)
    orow = gl.arange(0, BT, layout=gl.SliceLayout(1, io_layout))
    ocol = gl.arange(0, V, layout=gl.SliceLayout(0, io_layout))
    p_o = o + (bos.to(gl.int64) * HV + i_hv) * V
    offs = orow[:, None] * (HV * V) + ocol[None, :]
    mask = (orow[:, None] < n) & (ocol[None, :] < V)
    gl.store(p_o + offs, out, mask=mask)


_CHUNK_OUTPUT_FWD_GLUON_KERNEL = cached_launch(_chunk_output_fwd_gluon_kernel)


def gluon_output_supported(q: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor,
                           index: ChunkIndex) -> bool:
    """Whether :func:`chunk_output_fwd_gluon` serves these shapes and dtypes (the device
    is not checked): K = V = 128, chunks of 64, q/k/v_new/h one 16-bit dtype."""
    return (q.shape[-1] == _K and v_new.shape[-1] == _V and index.chunk_size == _BT
            and q.dtype in (torch.bfloat16, torch.float16)
            and v_new.dtype == q.dtype and h.dtype == q.dtype)


def _require_gluon_sm90(device: torch.device) -> None:
    require_sm90(device, "the Gluon output kernel")


@launcher(uses_atomics=False, kernels=(_chunk_output_fwd_gluon_kernel,))
def chunk_output_fwd_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    G: torch.Tensor,
    scale: float,
    index: ChunkIndex,
    group: int,
) -> torch.Tensor:
    """Output of every chunk, by the Gluon kernel (opt-in; the Triton kernel is the default).

    Args:
        q, k: ``[T, H, 128]`` bf16 or fp16; head ``hv // group`` serves value head ``hv``.
        v_new: ``[T, HV, 128]`` in q's dtype, from :func:`chunk_state_fwd`.
        h: ``[NT, HV, 128, 128]`` in q's dtype, the states entering each chunk.
        G: ``[T, HV]`` fp32 within-chunk cumsum of ``g`` (another float dtype is cast).
        scale: the output scale.
        index: the chunk table (chunks of 64 tokens).
        group: value heads per key head.

    Returns:
        ``o: [T, HV, 128]`` in q's dtype.

    Raises:
        ValueError: shapes that do not match (as :func:`chunk_output_fwd`), K or V not
            128, chunks not of 64, dtypes not one 16-bit type, or more rows than TMA's
            int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    T, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    NT = index.num_chunks
    if (
        tuple(k.shape) != (T, H, K)
        or v_new.shape[0] != T
        or HV != H * group
        or tuple(h.shape) != (NT, HV, K, V)
        or tuple(G.shape) != (T, HV)
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v_new {tuple(v_new.shape)}, "
            f"h {tuple(h.shape)}, G {tuple(G.shape)}, group {group}, chunks {NT}"
        )
    if (K, V) != (_K, _V) or index.chunk_size != _BT:
        raise ValueError(f"the Gluon output kernel serves K = V = {_K} and chunks of {_BT}, "
                         f"got K={K}, V={V}, chunk size {index.chunk_size}")
    if q.dtype not in (torch.bfloat16, torch.float16) or any(
            x.dtype != q.dtype for x in (k, v_new, h)):
        raise ValueError(f"the Gluon output kernel takes q, k, v_new, h in one 16-bit dtype, got "
                         f"{q.dtype}, {k.dtype}, {v_new.dtype}, {h.dtype}")
    if max(T, NT * HV * K) >= 2**31:
        raise ValueError(f"T={T} / NT*HV*K={NT * HV * K} exceed TMA's int32 coordinates")
    _require_gluon_sm90(q.device)
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    if NT == 0 or HV == 0 or T == 0:
        return o
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    q_desc = descriptor(q, [_BT, K])
    k_desc = descriptor(k, [_BT, K])
    v_desc = descriptor(v_new, [_BT, V])
    h_desc = descriptor(h.flatten(0, 2), [K, V])
    _CHUNK_OUTPUT_FWD_GLUON_KERNEL[(NT, HV)](
        q_desc, k_desc, v_desc, h_desc, G, o, index.chunk_start, index.chunk_len, float(scale), HV,
        GROUP=group, K=K, V=V, BT=_BT, num_warps=GLUON_OUTPUT_WARPS,
    )
    return o
