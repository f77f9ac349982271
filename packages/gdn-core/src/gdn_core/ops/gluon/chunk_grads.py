"""Backward stage (c), every chunk-local gradient, as ONE Gluon kernel for Hopper (sm_90a).

The default stage ``grads`` (since session 14) for K = V = 128, chunks of 64, 16-bit
inputs on sm_90. Same math, arguments and results as
:func:`gdn_core.ops.chunk_grads_bwd.chunk_grads_bwd` (its module docstring has the
formulas of dQ, dK, dv, dβ and of dg in the crossing-sum form); the Triton pair
(``_dq_dv_kernel`` + ``_dk_kernel``) serves every other shape.

**Grouped value heads** (``group > 1``, :func:`chunk_grads_bwd_gluon_summed`: the
backward's default since session 19): one CTA per (chunk, q/k head) runs the group's
value heads one after the other (:func:`_head_grads` per head; Q and K loaded once, the
other tiles refilled after a CTA barrier) and sums ``dq``/``dk`` over them in fp32 in the
order ``hv = h·group + 0, 1, …`` through an fp32 running-sum tile that the same threads
store and read back (L2-resident; in the backward, the spent ``h``/``dh`` tile of the
group's first value head: no memory taken), rounding the last head's sum into the output:
the additions and rounding of :func:`gdn_core.ops.group_reduce.group_reduce`, so the same
bits, without the ``[T, HV, K]`` fp32 partials or the two reduction launches. Compiled
for sm_90a (Triton 3.6, bf16): 250 registers, no spills, 221,224 B at group 2; 255
registers and 100 B of spills at group 4 (session 26; 232 and 48 B before).

The whole stage in one launch: one CTA per (chunk, value head), 8 warps (two
warpgroups), every product a ``warpgroup_mma`` with both operands in shared memory and
an fp32 accumulator in registers. Each warpgroup owns half the columns of every
product (``NVMMADistributedLayout(warps_per_cta [4, 2])``, ``m64n32k16`` for the
64×64 products, ``m64n64k16`` for the 64×128 ones): 16 registers a thread for a
64×64 fp32 accumulator, 32 for a 64×128 one.

Shared memory (16-bit, ``NVMMASharedLayout.get_default_for``, 128-byte swizzle), all
of it resident for the whole CTA — 200 KiB of tiles + 16 KiB compiler scratch
(the layout conversion of the crossing sums) = 221,216 B, so **one CTA per SM**:

* by TMA, on four mbarriers in the order of use: dO, V', Q, K (``[64, 128]`` each) |
  dU, ``A_inv`` (``[64, 64]`` of the ``[T, HV·64]`` view), V | ``h = S`` (``[128,
  128]`` of ``[NT·HV·K, V]``) | ``dh = dS``. ``h`` and ``dh`` are read from HBM once
  per (chunk, head) (the Triton pair reads them twice, and dO, dU, V', Q, K twice);
* written by the kernel: ``ds = dP ⊙ D · scale`` ``[64, 64]``, ``dT`` (then ``dT Tᵀ``
  in the same tile), ``E'`` and ``diag(β) E'`` ``[64, 64]``, and ``dW`` ``[64, 128]``
  in V's tile once V is spent. A transposed operand (``Tᵀ``, ``Kᵀ``, ``Qᵀ``, ``V'ᵀ``,
  ``Sᵀ``, ``dSᵀ``, ``dsᵀ``, ``(diag(β)E')ᵀ``) is a ``permute`` of a shared tile: no
  register transpose, no HBM round trip (the Triton pair writes ``E'`` over ``dT`` in
  ``dk`` and reads ``E'ᵀ`` back through swapped strides).

Order of the products (``→`` a result consumed in registers, ``⇒ smem`` a result
cast to 16 bits and stored as the next operand; fence + CTA barrier before a
``warpgroup_mma`` reads what threads stored):

A. ``dP = dO V'ᵀ``, ``Q Kᵀ`` (async pair) → ``ds`` ⇒ smem; crossing sums of
   ``Mo = ds ⊙ Q Kᵀ``. ``dṼ = Tᵀ dU`` → ``dv = β ⊙ dṼ`` (stored), ``v·dṼ``;
   ``X1 = dU Vᵀ`` (async, kept).
B. ``dO Sᵀ``, ``dU Sᵀ`` (async pair) → ``dQ_state = Γ scale dO Sᵀ``, ``q·dQ_state``;
   ``dQ = dQ_state + ds K`` (accumulated onto ``dQ_state``) stored;
   ``dW = −dU Sᵀ`` ⇒ smem (V's tile); ``X2 = dW Kᵀ``;
   ``dT = X1 ⊙ β_j + X2 ⊙ (βΓ)_j`` ⇒ smem. (The Triton kernel rounds ``βV`` and
   ``βΓK`` to 16 bits and accumulates both into one dot; here the column scales are
   applied in fp32 after two dots: one rounding fewer, no extra shared tiles.)
C. ``dT Tᵀ`` ⇒ smem (over ``dT``), ``K Kᵀ`` (async); ``Tᵀ (dT Tᵀ)`` → ``E'`` ⇒ smem,
   ``diag(β) E'`` ⇒ smem; crossing sums of ``Mw = E' ⊙ diag(β) K Kᵀ``.
D. ``Tᵀ dW`` and ``V' dSᵀ`` (async pair); ``⟨S, dS⟩`` from the shared tiles meanwhile
   (fixed order); ``acc = Γ ⊙ Tᵀ dW`` (``k·acc`` for dg), ``acc += E' K`` (= C, ``k·C``
   for dβ), ``acc = β ⊙ acc + (diag(β) E')ᵀ K``, ``acc += kd ⊙ V' dSᵀ`` (``k·dK_state``
   for dg), ``acc += dsᵀ Q`` = dK, stored. (``E'ᵀ (diag(β) K)`` of the Triton kernel
   is ``(diag(β) E')ᵀ K`` here: the β on the contracted index goes on the 64×64
   operand, not on a 64×128 one.)

Each phase is a ``@gluon.jit`` helper (``_phase_a_scores`` … ``_phase_d_dk``,
``_store_dg_dbeta``; inlined), cut where a kernel waits for a tile or issues a load: the
persistent kernel (:mod:`~gdn_core.ops.gluon.chunk_grads_pipelined`) calls the same ones
with its prefetches in between, as step 2 of docs/fused_backward.md would. Cutting them
out changed no PTX instruction of either kernel (session 18, Triton 3.6, bf16, group 1
and 2: the code sections of the PTX before and after are identical).

At most three fp32 accumulators are live at once (``X1`` through phase B, ``dT Tᵀ`` /
``K Kᵀ``, ``acc`` and ``V' dSᵀ`` in D). dQ, dK, dv are stored straight from the
accumulator layout (masked rows; no conversion scratch). dg and dβ: the Triton
kernels' terms in their order — ``cs(Mw) + cs(Mo) + exp(G_last)⟨S, dS⟩ +
Σ_{j<t} k_j·dK_state_j + Σ_{i≥t} β_i k_i·Γ(Tᵀ dW)_i + Σ_{i≥t} q_i·dQ_state_i`` and
``k·C + v·dṼ`` — with the crossing sums as in
:func:`~gdn_core.ops.chunk_grads_bwd.crossing_sums_t` (an inclusive reverse scan down the
columns in a layout that keeps a column in one warp, then a masked row sum: indexed by the
token as it comes out, no shift) and the exclusive prefix sum of ``k·dK_state`` with the
two suffix sums as ONE masked column sum (each term a select; no scan formed as inclusive
minus self, no total minus a prefix). Only pairs crossing ``t`` and only the tokens on the
right side of ``t`` are ever added, so no O(1) term cancels (docs/math.md). ``Mo``'s
crossing sums run while phase A's ``Tᵀ dU`` / ``dU Vᵀ`` are in flight, ``Mw``'s while
phase D's ``Tᵀ dW`` is. (Session 26: 4,616 → 4,280 SASS instructions, 244 → 232
registers, the kernel 1.5 % faster on an H100; before it the crossing sums took a shift
— a 64×64 masked reduce — and the three vector sums a masked reduce each.) No atomics,
a fixed order for every sum, each output row owned by one
CTA: two calls give the same bits. The partials of ``dg`` and ``dβ`` that the Triton
pair hands over through HBM (``[T, HV]`` fp32 each) and the ``dT`` hand-over stay on
chip.

Short chunks (the last of a document, ``n < 64``): TMA reads whole 64-row tiles, so
rows ``≥ n`` hold the next document's rows (zeros past ``T``). After the loads land,
rows ``≥ n`` of Q, K, V, V', dO, dU and rows/columns ``≥ n`` of ``A_inv`` are set to
zero in shared memory (a short chunk only) before any product, so no ``0 · NaN`` of
another document reaches a valid row; G and β are loaded masked (``Γ``, ``kd`` zero
past ``n``) and nothing is stored past row ``n``. That is the Triton kernels' masked-load
semantics, so the same masks (``i ≥ j``, ``i > j``, ``i < n``) follow.

``dq``/``dk``: fp32 per value head partials, or with ``group == 1`` the final values
in any float dtype (rounded once, at the store).

Results over inputs (``GDN_CORE_BWD_ALIAS``, :func:`gdn_core.ops.backward.plan_aliases`):
``dv`` may be the ``du`` buffer and, with ``group == 1`` and K = V, ``dq`` the ``v_new``
buffer. A CTA stores its ``dv`` rows after waiting for ``bars[1]`` (dU's tile landed) and
its ``dq`` rows after ``bars[0]`` (V'), reads them from shared memory only afterwards, and
no CTA but this one stores those rows; the rows past a short chunk's end that its TMA
tile reads (another CTA's, maybe already overwritten) are zeroed in V' and dU's tiles
(a select, so no NaN passes) before any product. The persistent kernel is not proven
for this, and the Triton pair's ``_dk_kernel`` re-reads V' and dU after ``_dq_dv_kernel``
stored ``dq``/``dv``: neither aliases.

Compiled for sm_90a with Triton 3.6 on a machine without a GPU, not yet run on one
(``PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/sm90_report.py gluon_grads``;
bf16, H = HV = 16 with bf16 ``dq``/``dk``, and H = 8, HV = 16 with fp32 partials)::

    warps=8 (the launcher's): 232 / 233 registers, 0 spills, 221,216 B shared,
                              4,280 / 4,248 SASS instructions
    warps=4 (one warpgroup):  255 registers, 428 / 456 B spill stores,
                              213,024 B shared, 7,432 / 7,376 SASS instructions

against the Triton pair at 4 warps (``sm90_report.py bwd``): ``_dq_dv_kernel`` 252
registers, 0 spills, 73,728 B; ``_dk_kernel`` 255 registers, 212 B spills, 57,344 B.
The PTX has 96 ``wgmma.mma_async`` (``m64n32k16``/``m64n64k16``) a warpgroup, 9 TMA
copies (each ``[·, 128]`` tile as two 64-column boxes from two warps).

What only the GPU can tell (docs/kernels.md): whether one CTA per SM with all loads
issued up front and a chain of 16 wgmma groups (most dependent) is faster than the
pair (nothing overlaps one CTA's loads with another's compute on the same SM; a
persistent variant that prefetches the next chunk needs the shared memory back —
e.g. ``h``/``dS`` in one buffer); the 80 ``bar.sync`` the membar pass puts around the
TMA issues; the cost of the crossing-sum scans and masked sums beside the products.
"""

from __future__ import annotations

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.ops.chunk_grads_bwd import grad_outputs
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

try:
    from triton.language import range as _loop  # tl.range: for its disable_licm
except ImportError:  # pragma: no cover - every Triton with Gluon has it
    _loop = range

__all__ = ["GLUON_CHUNK_GRADS_WARPS", "chunk_grads_bwd_gluon", "chunk_grads_bwd_gluon_summed",
           "gluon_chunk_grads_supported"]


#: Warps of the kernel: two warpgroups, each owning half the columns of every product.
GLUON_CHUNK_GRADS_WARPS = 8
_BT, _K, _V = 64, 128, 128


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _zero_rows(s, n, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
    """Rows ``>= n`` of the shared ``[R, C]`` tile ``s`` set to zero (a short chunk's
    tile holds the next document's rows there)."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    x = s.load(layout)
    s.store(gl.where((r < n)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _crossing_sums(M, BT: gl.constexpr, scan_layout: gl.constexpr, out_layout: gl.constexpr):
    """``c_t = Σ_{i ≥ t} Σ_{j < t} M_ij`` of a ``[BT, BT]`` fp32 tile, as
    :func:`gdn_core.ops.chunk_grads_bwd.crossing_sums_t`: an inclusive reverse scan down
    the columns (``R_tj = Σ_{i ≥ t} M_ij``; ``scan_layout`` keeps a column in one warp),
    then a masked row sum over ``j < t``. Only pairs crossing ``t`` are ever added, and the
    result is indexed by ``t`` as it comes out (no shift). Returned in ``out_layout`` (a
    row-vector layout)."""
    M = gl.convert_layout(M, scan_layout)
    R = gl.associative_scan(M, 0, _add, reverse=True)
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, scan_layout))
    c = gl.arange(0, BT, layout=gl.SliceLayout(0, scan_layout))
    out = gl.sum(gl.where(c[None, :] < r[:, None], R, 0.0), axis=1)
    return gl.convert_layout(out, out_layout)


@gluon.jit
def _split_sum(x, y, rows, cols, out_layout: gl.constexpr):
    """``Σ_{i < t} x_i + Σ_{i ≥ t} y_i`` (``x``, ``y`` row vectors of the layout ``rows`` /
    ``cols`` come from) as one masked column sum: an exclusive prefix sum of ``x`` and a
    suffix sum of ``y`` in a fixed order, each term a select (no scan formed as inclusive
    minus self, no total minus a prefix)."""
    s = gl.sum(gl.where(rows[:, None] < cols[None, :], x[:, None], y[:, None]), axis=0)
    return gl.convert_layout(s, out_layout)


@gluon.jit
def _store_rows(ptr, x, n, row_stride, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
    """``x`` (``[R, C]`` in ``layout``) stored to ``ptr + r·row_stride + c`` for rows ``< n``,
    cast to the pointee type, straight from the accumulator layout (no scratch)."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    offs = r[:, None] * row_stride + c[None, :]
    mask = (r[:, None] < n) & (c[None, :] < C)
    gl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _load_rows(ptr, n, row_stride, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
    """The fp32 ``[R, C]`` rows ``< n`` at ``ptr + r·row_stride + c`` in ``layout`` (rows
    ``>= n`` read 0): what :func:`_store_rows` stored there, read back by the same threads."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    offs = r[:, None] * row_stride + c[None, :]
    mask = (r[:, None] < n) & (c[None, :] < C)
    return gl.load(ptr + offs, mask=mask, other=0.0)


@gluon.jit
def _store_head_sum(out, acc_buf, x, j, p_o, n, row_stride, a_o, NHV: gl.constexpr,
                    R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
    """Store value head ``j``'s fp32 ``x`` (rows ``< n``, row 0 at element ``p_o`` of
    ``out``, rows ``row_stride`` apart). One head a CTA (``NHV == 1``): into ``out``. A q/k
    head's ``NHV`` value heads in one CTA: the running fp32 sum ``((0 + x_0) + x_1) + …``
    goes through the CTA's ``[R, C]`` fp32 tile at element ``a_o`` of ``acc_buf`` (rows
    ``C`` apart) and the last head's sum is rounded into ``out`` — the additions and the
    rounding of :func:`gdn_core.ops.group_reduce.group_reduce` over the per-value-head
    partials, in its order."""
    if NHV == 1:
        _store_rows(out + p_o, x, n, row_stride, R, C, layout)
    else:
        if j == 0:
            x = x + 0.0  # group_reduce's 0 + x_0 (a −0.0 partial becomes +0.0 there too)
        else:
            x = _load_rows(acc_buf + a_o, n, C, R, C, layout) + x
        if j == NHV - 1:
            _store_rows(out + p_o, x, n, row_stride, R, C, layout)
        else:
            _store_rows(acc_buf + a_o, x, n, C, R, C, layout)


@gluon.jit
def _chunk_vectors(G, beta, p_s, n, HV, rows, cols, R128: gl.constexpr):
    """The chunk's ``G``, ``β`` and ``Γ`` as row and column vectors (masked: rows ``>= n``
    read 0), ``G_last``, and ``Γ``, ``β``, ``kd = exp(G_last − G)`` in the 64×128
    accumulators' row layout ``R128``."""
    g_r = gl.load(G + p_s + rows * HV, mask=rows < n, other=0.0).to(gl.float32)
    g_c = gl.load(G + p_s + cols * HV, mask=cols < n, other=0.0).to(gl.float32)
    b_r = gl.load(beta + p_s + rows * HV, mask=rows < n, other=0.0).to(gl.float32)
    b_c = gl.load(beta + p_s + cols * HV, mask=cols < n, other=0.0).to(gl.float32)
    gam_r = gl.where(rows < n, gl.exp(g_r), 0.0)
    gam_c = gl.where(cols < n, gl.exp(g_c), 0.0)
    g_last = gl.load(G + p_s + (n - 1) * HV).to(gl.float32)
    gam_r128 = gl.convert_layout(gam_r, R128)
    b_r128 = gl.convert_layout(b_r, R128)
    kd128 = gl.convert_layout(gl.where(rows < n, gl.exp(g_last - g_r), 0.0), R128)
    return g_r, g_c, b_r, b_c, gam_r, gam_c, g_last, gam_r128, b_r128, kd128


@gluon.jit
def _zero_short_chunk(q_s, k_s, v_s, vn_s, do_s, du_s, a_s, n, BT: gl.constexpr,
                      K: gl.constexpr, V: gl.constexpr, IO: gl.constexpr,
                      SCAN: gl.constexpr):
    """A short chunk's rows ``>= n`` of every token tile, and ``A_inv``'s rows and columns
    ``>= n``, set to zero (a select: NaN is cleared too) once the tiles have landed."""
    _zero_rows(q_s, n, BT, K, IO)
    _zero_rows(k_s, n, BT, K, IO)
    _zero_rows(v_s, n, BT, V, IO)
    _zero_rows(vn_s, n, BT, V, IO)
    _zero_rows(do_s, n, BT, V, IO)
    _zero_rows(du_s, n, BT, V, IO)
    ar = gl.arange(0, BT, layout=gl.SliceLayout(1, SCAN))
    ac = gl.arange(0, BT, layout=gl.SliceLayout(0, SCAN))
    at = a_s.load(SCAN)
    a_s.store(gl.where((ar[:, None] < n) & (ac[None, :] < n), at, gl.zeros_like(at)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _phase_a_scores(dp, qk, do_s, vn_s, q_s, k_s, ds_s, rows, cols, g_r, g_c, n, scale):
    """Phase A, after the caller issued ``dp = dO V'ᵀ`` then ``qk = Q Kᵀ``: ``ds = dP ⊙ D ·
    scale`` stored to ``ds_s``; ``Mo = ds ⊙ Q Kᵀ`` returned (its crossing sums are formed
    in :func:`_phase_a_values`, while that phase's products run)."""
    dp = warpgroup_mma_wait(1, deps=[dp, do_s, vn_s])[0]
    m_low = (rows[:, None] >= cols[None, :]) & (rows[:, None] < n)
    ds = dp * gl.exp(gl.where(m_low, g_r[:, None] - g_c[None, :], float("-inf"))) * scale
    ds_s.store(ds.to(ds_s.dtype))
    qk = warpgroup_mma_wait(0, deps=[qk, q_s, k_s])[0]
    return ds * qk  # Mo = (dP ⊙ D) scale ⊙ Q Kᵀ


@gluon.jit
def _phase_a_values(a_s, du_s, v_s, z64, z128, dv, p_s, b_r128, n, HV, mo, BT: gl.constexpr,
                    V: gl.constexpr, L128: gl.constexpr, SCAN: gl.constexpr,
                    R64: gl.constexpr, OVERLAP: gl.constexpr = True):
    """``dṼ = Tᵀ dU`` (``dv = β ⊙ dṼ`` stored, ``v·dṼ`` returned) and ``X1 = dU Vᵀ``
    (dT's dU half) issued, returned still in flight; the crossing sums of ``mo`` (phase
    A's ``Mo``) returned, formed while both products run (``OVERLAP=False``: before they
    are issued — the same bits, fewer live registers)."""
    if not OVERLAP:
        cs_o = _crossing_sums(mo, BT, SCAN, R64)
    dvt = warpgroup_mma(a_s.permute((1, 0)), du_s, z128, use_acc=False, is_async=True)
    x1 = warpgroup_mma(du_s, v_s.permute((1, 0)), z64, use_acc=False, is_async=True)
    if OVERLAP:
        cs_o = _crossing_sums(mo, BT, SCAN, R64)
    dvt = warpgroup_mma_wait(1, deps=[dvt, a_s, du_s])[0]
    db_v = gl.sum(dvt * v_s.load(L128).to(gl.float32), axis=1)  # v·dṼ
    _store_rows(dv + p_s * V, dvt * b_r128[:, None], n, HV * V, BT, V, L128)
    return x1, db_v, cs_o


@gluon.jit
def _phase_b_dq(x1, do_s, du_s, h_s, q_s, k_s, v_s, ds_s, z128, dq, dq_acc, j, p_o, o_stride,
                a_o, gam_r128, n, scale, NHV: gl.constexpr, BT: gl.constexpr,
                K: gl.constexpr, L128: gl.constexpr):
    """Phase B up to ``dQ``: ``dQ_state = Γ scale dO Sᵀ`` (``q·dQ_state`` returned), ``dQ =
    dQ_state + ds K`` stored (:func:`_store_head_sum`: value head ``j`` of ``NHV``, row 0 at
    ``p_o``, the running sum at ``a_o``), ``dW = −dU Sᵀ`` rounded into V's spent tile
    (returned as ``dw_s``), ``X1`` waited; ends with a CTA barrier (every warp's stores
    done)."""
    dqs = warpgroup_mma(do_s, h_s.permute((1, 0)), z128, use_acc=False, is_async=True)
    dwn = warpgroup_mma(du_s, h_s.permute((1, 0)), z128, use_acc=False, is_async=True)
    x1 = warpgroup_mma_wait(2, deps=[x1, du_s, v_s])[0]
    dqs = warpgroup_mma_wait(1, deps=[dqs, do_s, h_s])[0]
    dqs = dqs * (gam_r128 * scale)[:, None]
    dgq = gl.sum(q_s.load(L128).to(gl.float32) * dqs, axis=1)  # q·dQ_state
    fence_async_shared()
    gl.thread_barrier()  # ds_s written by both warpgroups; v_s read by all (x1, db_v)
    dqa = warpgroup_mma(ds_s, k_s, dqs, is_async=True)
    dwn = warpgroup_mma_wait(1, deps=[dwn, du_s, h_s])[0]
    dw_s = v_s  # V is spent: its tile carries dW (16-bit, as the Triton kernels round it)
    dw_s.store((-dwn).to(dw_s.dtype))
    dqa = warpgroup_mma_wait(0, deps=[dqa, ds_s, k_s])[0]
    _store_head_sum(dq, dq_acc, dqa, j, p_o, n, o_stride, a_o, NHV, BT, K, L128)
    fence_async_shared()
    gl.thread_barrier()
    return x1, dgq, dw_s


@gluon.jit
def _phase_b_dt(x1, dw_s, k_s, z64, b_c, gam_c):
    """``dT = dU (βV)ᵀ + dW (βΓK)ᵀ``: β, βΓ on the columns in fp32 (Triton rounds βV, βΓK)."""
    x2 = warpgroup_mma(dw_s, k_s.permute((1, 0)), z64, use_acc=False, is_async=True)
    x2 = warpgroup_mma_wait(0, deps=[x2, dw_s, k_s])[0]
    return x1 * b_c[None, :] + x2 * (b_c * gam_c)[None, :]


@gluon.jit
def _phase_c(d_t, dt_s, a_s, k_s, e_s, eb_s, z64, rows, cols, g_r, g_c, b_r, n,
             E_OVER_DT: gl.constexpr = False):
    """Phase C: ``E' = (−Tᵀ dT Tᵀ) ⊙ e`` on the strict lower triangle into ``e_s`` and
    ``diag(β) E'`` into ``eb_s``, ``K Kᵀ``, and ``Mw = E' ⊙ diag(β) K Kᵀ`` returned (the
    caller forms its crossing sums once phase D's first product is issued); ends with a
    CTA barrier. ``E_OVER_DT``: ``e_s`` is ``dt_s`` (8 KB
    of shared memory less; a CTA barrier before ``E'`` overwrites ``dT Tᵀ``)."""
    dtype: gl.constexpr = dt_s.dtype
    dt_s.store(d_t.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    xx = warpgroup_mma(dt_s, a_s.permute((1, 0)), z64, use_acc=False, is_async=True)
    kk = warpgroup_mma(k_s, k_s.permute((1, 0)), z64, use_acc=False, is_async=True)
    xx = warpgroup_mma_wait(1, deps=[xx, dt_s, a_s])[0]
    gl.thread_barrier()  # both warpgroups' reads of dT are done: its tile takes dT Tᵀ
    dt_s.store(xx.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    da = warpgroup_mma(a_s.permute((1, 0)), dt_s, z64, use_acc=False, is_async=True)
    kk = warpgroup_mma_wait(1, deps=[kk, k_s])[0]
    da = warpgroup_mma_wait(0, deps=[da, a_s, dt_s])[0]
    if E_OVER_DT:
        gl.thread_barrier()  # both warpgroups' reads of dT Tᵀ are done: its tile takes E'
    m_low1 = (rows[:, None] > cols[None, :]) & (rows[:, None] < n)
    e = gl.where(m_low1, -da * gl.exp(gl.where(m_low1, g_r[:, None] - g_c[None, :], 0.0)), 0.0)
    e_s.store(e.to(dtype))
    eb_s.store((e * b_r[:, None]).to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    return e * b_r[:, None] * kk  # Mw = E' ⊙ diag(β) K Kᵀ


@gluon.jit
def _state_dot(h_s, dh_s, K: gl.constexpr, V: gl.constexpr, IO: gl.constexpr):
    """``⟨S, dS⟩`` of the shared ``[K, V]`` tiles, in a fixed order (rows in blocks of 32)."""
    SB: gl.constexpr = 32
    pr = gl.zeros([SB, V], gl.float32, IO)
    for i in gl.static_range(K // SB):
        pr += (h_s.slice(i * SB, SB).load(IO).to(gl.float32)
               * dh_s.slice(i * SB, SB).load(IO).to(gl.float32))
    return gl.sum(gl.sum(pr, axis=1), axis=0)


@gluon.jit
def _phase_d_state(acc, a_s, dw_s, vn_s, h_s, dh_s, z128, K: gl.constexpr, V: gl.constexpr,
                   IO: gl.constexpr, DOT: gl.constexpr = True):
    """Phase D, after the caller issued ``acc = Tᵀ dW`` and waited for ``dS``: ``dks = V'
    dSᵀ`` issued (returned in flight), ``⟨S, dS⟩`` (:func:`_state_dot`) from shared memory
    meanwhile, ``acc`` waited. ``DOT=False``: the caller formed ``⟨S, dS⟩`` earlier (0.0
    returned in its place)."""
    dks = warpgroup_mma(vn_s, dh_s.permute((1, 0)), z128, use_acc=False, is_async=True)
    if DOT:
        sds = _state_dot(h_s, dh_s, K, V, IO)
    else:
        sds = 0.0
    acc = warpgroup_mma_wait(1, deps=[acc, a_s, dw_s])[0]
    return acc, dks, sds


@gluon.jit
def _phase_d_c(acc, dks, e_s, k_s, vn_s, dh_s, gam_r128, L128: gl.constexpr):
    """``acc = Γ ⊙ Tᵀ dW`` (``k·acc`` returned), ``+= E' K`` (= C); ``acc`` and ``dks``
    waited; K's rows in fp32 returned for the next sums."""
    acc = acc * gam_r128[:, None]
    k_r = k_s.load(L128).to(gl.float32)
    wr = gl.sum(acc * k_r, axis=1)  # k·Γ(Tᵀ dW)
    acc = warpgroup_mma(e_s, k_s, acc, is_async=True)  # C
    acc, dks, _, _, _, _ = warpgroup_mma_wait(0, deps=[acc, dks, e_s, k_s, vn_s, dh_s])
    return acc, dks, k_r, wr


@gluon.jit
def _phase_d_dk(acc, dks, k_r, eb_s, ds_s, k_s, q_s, b_r128, kd128):
    """``k·C``; ``acc = β ⊙ C + (diag(β) E')ᵀ K``; ``dK_state = kd ⊙ dks`` (``k·dK_state``);
    ``dK = acc + dK_state + dsᵀ Q`` (returned, waited)."""
    db_c = gl.sum(acc * k_r, axis=1)  # k·C
    acc = warpgroup_mma(eb_s.permute((1, 0)), k_s, acc * b_r128[:, None], is_async=True)
    dks = dks * kd128[:, None]
    kds = gl.sum(k_r * dks, axis=1)  # k·dK_state
    acc = warpgroup_mma_wait(0, deps=[acc, eb_s, k_s])[0]
    acc = warpgroup_mma(ds_s.permute((1, 0)), q_s, acc + dks, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc, ds_s, q_s])[0]
    return acc, db_c, kds


@gluon.jit
def _store_dg_dbeta(dg, dbeta, p_s, n, HV, rows, cols, cs_w, cs_o, g_last, sds, kds, wr, dgq,
                    db_c, db_v, b_r, R64: gl.constexpr):
    """``dg`` and ``dβ`` of the chunk's rows ``< n``, the Triton kernels' terms in their
    order."""
    b_dg = cs_w + cs_o
    b_dg += gl.exp(g_last) * sds
    y = b_r * gl.convert_layout(wr, R64) + gl.convert_layout(dgq, R64)
    b_dg += _split_sum(gl.convert_layout(kds, R64), y, rows, cols, R64)
    b_db = gl.convert_layout(db_c, R64) + gl.convert_layout(db_v, R64)
    m = rows < n
    gl.store(dg + p_s + rows * HV, b_dg.to(dg.dtype.element_ty), mask=m)
    gl.store(dbeta + p_s + rows * HV, b_db.to(dbeta.dtype.element_ty), mask=m)


@gluon.jit
def _head_grads(q_desc, k_desc, v_desc, vn_desc, do_desc, du_desc, h_desc, dh_desc, a_desc,
                G, beta, dq, dk, dv, dbeta, dg, dq_acc, dk_acc,
                q_s, k_s, v_s, vn_s, do_s, du_s, h_s, dh_s, a_s, ds_s, dt_s, e_s, eb_s, bars,
                i_c, i_h, i_hv, j, ph, bos, n, scale, HV, p_o, o_stride, a_o,
                NHV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                L64: gl.constexpr, L128: gl.constexpr, IO: gl.constexpr,
                SCAN: gl.constexpr):
    """Every gradient of one (chunk, value head) tile: its loads (``bars[0..3]`` waited with
    parity ``ph``; with ``NHV > 1`` Q and K are the CTA's already, on ``bars[4]``), phases
    A-D, and its stores (``dq``/``dk`` through :func:`_store_head_sum`: with ``NHV == 1``
    at the tile's rows of ``[T, HV, K]``, else row 0 at ``p_o``, rows ``o_stride`` apart,
    the running sums' tiles at ``a_o``)."""
    R64: gl.constexpr = gl.SliceLayout(1, L64)
    C64: gl.constexpr = gl.SliceLayout(0, L64)
    R128: gl.constexpr = gl.SliceLayout(1, L128)

    # --- TMA: dO, V', (Q, K) | dU, A_inv, V | h | dS, in the order of use
    tv = i_hv * V
    if NHV == 1:
        tk = i_h * K
        mbarrier.expect(bars.index(0), 4 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [bos, tv], bars.index(0), do_s)
        tma.async_copy_global_to_shared(vn_desc, [bos, tv], bars.index(0), vn_s)
        tma.async_copy_global_to_shared(q_desc, [bos, tk], bars.index(0), q_s)
        tma.async_copy_global_to_shared(k_desc, [bos, tk], bars.index(0), k_s)
    else:
        if j > 0:  # every warp is done with the previous head's tiles before TMA refills them
            fence_async_shared()
            gl.thread_barrier()
        mbarrier.expect(bars.index(0), 2 * do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [bos, tv], bars.index(0), do_s)
        tma.async_copy_global_to_shared(vn_desc, [bos, tv], bars.index(0), vn_s)
    mbarrier.expect(bars.index(1), 2 * du_desc.block_type.nbytes + a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(du_desc, [bos, tv], bars.index(1), du_s)
    tma.async_copy_global_to_shared(a_desc, [bos, i_hv * BT], bars.index(1), a_s)
    tma.async_copy_global_to_shared(v_desc, [bos, tv], bars.index(1), v_s)
    st = (i_c * HV + i_hv) * K
    mbarrier.expect(bars.index(2), h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(h_desc, [st, 0], bars.index(2), h_s)
    mbarrier.expect(bars.index(3), dh_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(dh_desc, [st, 0], bars.index(3), dh_s)

    # --- G, β, Γ of the chunk (masked: rows >= n read 0) while the copies fly
    rows = gl.arange(0, BT, layout=R64)
    cols = gl.arange(0, BT, layout=C64)
    p_s = bos.to(gl.int64) * HV + i_hv
    if NHV == 1:  # dq/dk: [T, HV, K]
        p_o = p_s * K
        o_stride = HV * K
    g_r, g_c, b_r, b_c, gam_r, gam_c, g_last, gam_r128, b_r128, kd128 = _chunk_vectors(
        G, beta, p_s, n, HV, rows, cols, R128)

    # --- a short chunk: rows >= n of every token tile (and T's columns >= n) to zero
    # before any product can bring 0·NaN of the next document into a valid row
    if n < BT:
        if NHV > 1:
            mbarrier.wait(bars.index(4), 0)
        mbarrier.wait(bars.index(0), ph)
        mbarrier.wait(bars.index(1), ph)
        _zero_short_chunk(q_s, k_s, v_s, vn_s, do_s, du_s, a_s, n, BT, K, V, IO, SCAN)

    z64 = gl.zeros([BT, BT], gl.float32, L64)
    z128 = gl.zeros([BT, V], gl.float32, L128)

    # ---- A: dP = dO V'ᵀ and Q Kᵀ; ds = dP ⊙ D · scale; Mo's crossing sums
    if NHV > 1:
        mbarrier.wait(bars.index(4), 0)
    mbarrier.wait(bars.index(0), ph)
    dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), z64, use_acc=False, is_async=True)
    qk = warpgroup_mma(q_s, k_s.permute((1, 0)), z64, use_acc=False, is_async=True)
    mo = _phase_a_scores(dp, qk, do_s, vn_s, q_s, k_s, ds_s, rows, cols, g_r, g_c, n, scale)
    mbarrier.wait(bars.index(1), ph)
    x1, db_v, cs_o = _phase_a_values(a_s, du_s, v_s, z64, z128, dv, p_s, b_r128, n, HV, mo,
                                     BT, V, L128, SCAN, R64)

    # ---- B: dQ_state = dO Sᵀ, -dW = dU Sᵀ; dQ = Γ scale dQ_state + ds K (stored)
    mbarrier.wait(bars.index(2), ph)
    x1, dgq, dw_s = _phase_b_dq(x1, do_s, du_s, h_s, q_s, k_s, v_s, ds_s, z128, dq, dq_acc, j,
                                p_o, o_stride, a_o, gam_r128, n, scale, NHV, BT, K, L128)
    d_t = _phase_b_dt(x1, dw_s, k_s, z64, b_c, gam_c)

    # ---- C: E' = (−Tᵀ dT Tᵀ) ⊙ e on the strict lower triangle; K Kᵀ; Mw's crossing sums
    mw = _phase_c(d_t, dt_s, a_s, k_s, e_s, eb_s, z64, rows, cols, g_r, g_c, b_r, n)

    # ---- D: dK = kd ⊙ V' dSᵀ + (dP ⊙ D)ᵀ scale Q + β ⊙ C + E'ᵀ (βK),
    #         C = Γ ⊙ (Tᵀ dW) + E' K; Mw's crossing sums while Tᵀ dW runs
    acc = warpgroup_mma(a_s.permute((1, 0)), dw_s, z128, use_acc=False, is_async=True)
    cs_w = _crossing_sums(mw, BT, SCAN, R64)
    mbarrier.wait(bars.index(3), ph)
    acc, dks, sds = _phase_d_state(acc, a_s, dw_s, vn_s, h_s, dh_s, z128, K, V, IO)
    acc, dks, k_r, wr = _phase_d_c(acc, dks, e_s, k_s, vn_s, dh_s, gam_r128, L128)
    acc, db_c, kds = _phase_d_dk(acc, dks, k_r, eb_s, ds_s, k_s, q_s, b_r128, kd128)
    _store_head_sum(dk, dk_acc, acc, j, p_o, n, o_stride, a_o, NHV, BT, K, L128)
    return rows, cols, p_s, cs_w, cs_o, g_last, sds, kds, wr, dgq, db_c, db_v, b_r


@gluon.jit
def _chunk_grads_bwd_gluon_kernel(
    q_desc, k_desc, v_desc, vn_desc, do_desc, du_desc, h_desc, dh_desc, a_desc,
    G, beta, dq, dk, dv, dbeta, dg,
    chunk_start, chunk_len, scale, HV, dq_acc, dk_acc, acc_chunk_stride, acc_head_stride,
    GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    SUM_GROUP: gl.constexpr = False,
):
    gl.static_assert(K == V)
    i_c = gl.program_id(0)
    if SUM_GROUP:  # one CTA a (chunk, q/k head): its GROUP value heads in turn
        i_h = gl.program_id(1)
        hv0 = i_h * GROUP
    else:  # one CTA a (chunk, value head)
        hv0 = gl.program_id(1)
        i_h = hv0 // GROUP
    NHV: gl.constexpr = GROUP if SUM_GROUP else 1
    bos = gl.load(chunk_start + i_c)
    n = gl.load(chunk_len + i_c)
    dtype: gl.constexpr = q_desc.dtype
    WG: gl.constexpr = gl.num_warps() // 4  # warpgroups; each owns 1/WG of the columns

    # --- register layouts
    L64: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BT // WG, 16])
    L128: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, V // WG, 16])
    R64: gl.constexpr = gl.SliceLayout(1, L64)
    IO: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4 * WG, 1],
        order=[1, 0])
    SCAN: gl.constexpr = gl.BlockedLayout(  # a column of a 64x64 tile in one warp
        size_per_thread=[2, 1], threads_per_warp=[32, 1], warps_per_cta=[1, 4 * WG],
        order=[0, 1])
    t64: gl.constexpr = a_desc.layout  # NVMMA layout of a [64, 64] 16-bit tile

    # --- shared memory: every input tile of the chunk once, and the 64x64 operands
    q_s = gl.allocate_shared_memory(dtype, [BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)  # later: dW
    vn_s = gl.allocate_shared_memory(dtype, [BT, V], vn_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [BT, V], do_desc.layout)
    du_s = gl.allocate_shared_memory(dtype, [BT, V], du_desc.layout)
    h_s = gl.allocate_shared_memory(dtype, [K, V], h_desc.layout)
    dh_s = gl.allocate_shared_memory(dtype, [K, V], dh_desc.layout)
    a_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # T = A_inv (row-major)
    ds_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # dP ⊙ D · scale
    dt_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # dT, then dT Tᵀ
    e_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # E'
    eb_s = gl.allocate_shared_memory(dtype, [BT, BT], t64)  # diag(β) E'
    NBAR: gl.constexpr = 4 if NHV == 1 else 5  # bars[4]: the group's Q and K, loaded once
    bars = gl.allocate_shared_memory(gl.int64, [NBAR, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBAR):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    if NHV == 1:
        rows, cols, p_s, cs_w, cs_o, g_last, sds, kds, wr, dgq, db_c, db_v, b_r = _head_grads(
            q_desc, k_desc, v_desc, vn_desc, do_desc, du_desc, h_desc, dh_desc, a_desc,
            G, beta, dq, dk, dv, dbeta, dg, dq_acc, dk_acc,
            q_s, k_s, v_s, vn_s, do_s, du_s, h_s, dh_s, a_s, ds_s, dt_s, e_s, eb_s, bars,
            i_c, i_h, hv0, 0, 0, bos, n, scale, HV, 0, 0, 0, NHV, K, V, BT,
            L64, L128, IO, SCAN)
        for i in gl.static_range(NBAR):
            mbarrier.invalidate(bars.index(i))
        # ---- dg, dβ (the Triton kernels' order of terms)
        _store_dg_dbeta(dg, dbeta, p_s, n, HV, rows, cols, cs_w, cs_o, g_last, sds, kds, wr,
                        dgq, db_c, db_v, b_r, R64)
    else:
        tk = i_h * K
        mbarrier.expect(bars.index(4), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bos, tk], bars.index(4), q_s)
        tma.async_copy_global_to_shared(k_desc, [bos, tk], bars.index(4), k_s)
        H = HV // GROUP
        p_o = (bos.to(gl.int64) * H + i_h) * K  # dq/dk: [T, H, K]
        # the running sums: this CTA's [BT, K] fp32 tile of dq_acc / dk_acc
        a_o = i_c.to(gl.int64) * acc_chunk_stride + i_h.to(gl.int64) * acc_head_stride
        # disable_licm: hoisting the body's thread-invariant shared-memory offsets out of
        # the loop would keep them live through it (the persistent kernel's reason too)
        for j in _loop(0, NHV, disable_licm=True):
            rows, cols, p_s, cs_w, cs_o, g_last, sds, kds, wr, dgq, db_c, db_v, b_r = \
                _head_grads(
                    q_desc, k_desc, v_desc, vn_desc, do_desc, du_desc, h_desc, dh_desc,
                    a_desc, G, beta, dq, dk, dv, dbeta, dg, dq_acc, dk_acc,
                    q_s, k_s, v_s, vn_s, do_s, du_s, h_s, dh_s, a_s, ds_s, dt_s, e_s, eb_s,
                    bars, i_c, i_h, hv0 + j, j, j & 1, bos, n, scale, HV, p_o, H * K, a_o,
                    NHV, K, V, BT, L64, L128, IO, SCAN)
            _store_dg_dbeta(dg, dbeta, p_s, n, HV, rows, cols, cs_w, cs_o, g_last, sds, kds,
                            wr, dgq, db_c, db_v, b_r, R64)
        for i in gl.static_range(NBAR):
            mbarrier.invalidate(bars.index(i))


_CHUNK_GRADS_BWD_GLUON_KERNEL = cached_launch(_chunk_grads_bwd_gluon_kernel)


def gluon_chunk_grads_supported(q: torch.Tensor, v: torch.Tensor, A_inv: torch.Tensor,
                                index: ChunkIndex) -> bool:
    """Whether :func:`chunk_grads_bwd_gluon` serves these shapes and dtypes (the device is
    not checked, nor the other tensors): K = V = 128, chunks of 64, q, v and A_inv of one
    16-bit dtype."""
    return (q.shape[-1] == _K and v.shape[-1] == _V and index.chunk_size == _BT
            and q.dtype in (torch.bfloat16, torch.float16)
            and v.dtype == q.dtype and A_inv.dtype == q.dtype)


def _require_gluon_sm90(device: torch.device) -> None:
    require_sm90(device, "the Gluon chunk-gradient kernel")


def _descriptors(q, k, v, v_new, h, dh, do, du, A_inv) -> dict:
    """TMA descriptors over the 2-D views the kernel tiles (CPU tensors suffice to build
    them, for :mod:`tools.sm90_report`)."""
    K, V = q.shape[-1], v.shape[-1]
    BT = A_inv.shape[-1]
    return dict(
        q_desc=descriptor(q, [BT, K]),
        k_desc=descriptor(k, [BT, K]),
        v_desc=descriptor(v, [BT, V]),
        vn_desc=descriptor(v_new, [BT, V]),
        do_desc=descriptor(do, [BT, V]),
        du_desc=descriptor(du, [BT, V]),
        h_desc=descriptor(h.flatten(0, 2), [K, V]),
        dh_desc=descriptor(dh.flatten(0, 2), [K, V]),
        a_desc=descriptor(A_inv, [BT, BT]),
    )


def prepare_launch(q, k, v, v_new, h, dh, do, du, G, beta, A_inv, index: ChunkIndex,
                   group: int, g_dtype: torch.dtype, dq, dk, dv, dbeta, dg,
                   sum_group: bool = False):
    """The checks and buffers of a chunk-gradient launch (:func:`chunk_grads_bwd_gluon`'s
    arguments; shared with the persistent kernel's launcher): ``((dq, dk, dv, dbeta,
    dg), (descriptors, G fp32, beta))``, the second ``None`` when there is nothing to
    launch. ``sum_group``: ``dq``/``dk`` are ``[T, H, K]`` (allocated in q's dtype where
    ``None``), else ``[T, HV, K]`` (fp32 where ``None``). Raises what
    :func:`chunk_grads_bwd_gluon` documents."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    NT = index.num_chunks
    C = index.chunk_size
    if (
        tuple(k.shape) != (T, H, K)
        or HV != H * group
        or any(tuple(x.shape) != (T, HV, V) for x in (v_new, do, du))
        or any(tuple(x.shape) != (NT, HV, K, V) for x in (h, dh))
        or tuple(G.shape) != (T, HV)
        or tuple(beta.shape) != (T, HV)
        or tuple(A_inv.shape) != (T, HV, C)
        or T != index.total_tokens
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"v_new {tuple(v_new.shape)}, do {tuple(do.shape)}, du {tuple(du.shape)}, "
            f"h {tuple(h.shape)}, dh {tuple(dh.shape)}, G {tuple(G.shape)}, "
            f"beta {tuple(beta.shape)}, A_inv {tuple(A_inv.shape)}, group {group}, "
            f"chunks {NT}")
    if (K, V) != (_K, _V) or C != _BT:
        raise ValueError(f"the Gluon chunk-gradient kernel serves K = V = {_K} and chunks of "
                         f"{_BT}, got K={K}, V={V}, chunk size {C}")
    tiled = (q, k, v, v_new, h, dh, do, du, A_inv)
    if q.dtype not in (torch.bfloat16, torch.float16) or any(x.dtype != q.dtype for x in tiled):
        raise ValueError("the Gluon chunk-gradient kernel takes q, k, v, v_new, h, dh, do, du, "
                         "A_inv in one 16-bit dtype, got "
                         + ", ".join(str(x.dtype) for x in tiled))
    if max(T, NT * HV * K) >= 2**31 or NT * HV >= 2**31:
        raise ValueError(f"T={T} / NT*HV*K={NT * HV * K} exceed TMA's int32 coordinates")
    bufs = []
    shape, default = ((T, H, K), q.dtype) if sum_group else ((T, HV, K), torch.float32)
    for name, buf in (("dq", dq), ("dk", dk)):
        if buf is None:
            buf = torch.empty(shape, dtype=default, device=q.device)
        elif tuple(buf.shape) != shape or not buf.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {shape} tensor, got "
                             f"{tuple(buf.shape)} (contiguous={buf.is_contiguous()})")
        bufs.append(buf)
    _require_gluon_sm90(q.device)
    dq, dk = bufs
    dv, dbeta, dg = grad_outputs(T, HV, V, v, beta, g_dtype, dv, dbeta, dg)
    if NT == 0 or HV == 0 or T == 0:
        return (dq, dk, dv, dbeta, dg), None
    G = G.contiguous() if G.dtype == torch.float32 else G.float().contiguous()
    beta = beta.contiguous()
    return (dq, dk, dv, dbeta, dg), (_descriptors(*tiled), G, beta)


@launcher(uses_atomics=False, kernels=(_chunk_grads_bwd_gluon_kernel,))
def chunk_grads_bwd_gluon(
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
    """Every chunk-local gradient after the state backward, in one Gluon launch.

    The contract of :func:`gdn_core.ops.chunk_grads_bwd.chunk_grads_bwd`: ``q, k:
    [T,H,128]``; ``v, v_new, do, du (= dV'): [T,HV,128]``; ``h, dh: [NT,HV,128,128]``;
    ``G, beta: [T,HV]`` (``G`` fp32; another float dtype is cast); ``A_inv: [T,HV,64]``
    (:func:`~gdn_core.ops.wy.inverse_for_backward`'s 16-bit copy). ``q, k, v, v_new, h,
    dh, do, du, A_inv`` in one 16-bit dtype. ``dq``/``dk``: result buffers ``[T,HV,K]``
    contiguous, fp32 per value head partials (the default) or, with ``group == 1``, the
    final gradients in any float dtype.

    Returns ``(dq, dk, dv [T,HV,V] in v's dtype, dbeta [T,HV] in beta's dtype,
    dg [T,HV] in g_dtype)``.

    Raises:
        ValueError: shapes that do not match, K or V not 128, chunks not of 64, the tiled
            tensors not of one 16-bit dtype, a ``dq``/``dk`` buffer of another shape or
            not contiguous, or more rows than TMA's int32 coordinates address.
        RuntimeError: Gluon not importable, or the tensors not on a CUDA sm_90 device.
    """
    return _launch(q, k, v, v_new, h, dh, do, du, G, beta, A_inv, scale, index, group,
                   g_dtype, dq, dk, dv, dbeta, dg, sum_group=False)


@launcher(uses_atomics=False, kernels=(_chunk_grads_bwd_gluon_kernel,))
def chunk_grads_bwd_gluon_summed(
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
    spend_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`chunk_grads_bwd_gluon` with ``dq``/``dk`` summed over each q/k head's group
    of value heads in the kernel: one CTA per (chunk, q/k head) runs the group's value
    heads in turn (Q and K loaded once). ``dq``/``dk``: ``[T, H, 128]`` result buffers
    (allocated in q's dtype where ``None``), the bits of
    :func:`gdn_core.ops.group_reduce.group_reduce` over :func:`chunk_grads_bwd_gluon`'s
    per-value-head fp32 partials, without those partials (``[T, HV, 128]`` fp32 each) or
    the two reduction launches. ``group == 1`` is :func:`chunk_grads_bwd_gluon`'s launch.

    The running fp32 sums take one ``[64, 128]`` fp32 tile per (chunk, q/k head) each.
    ``spend_states=True`` (``h`` and ``dh`` contiguous): they go through ``h``'s and
    ``dh``'s own storage, in the tile of each group's first value head once that tile has
    landed in shared memory (the same bytes: 128×128 16-bit), so **``h`` and ``dh`` are
    overwritten** and no memory is taken; otherwise two ``[NT, H, 64·128]`` fp32 buffers
    are allocated.

    Returns and raises what :func:`chunk_grads_bwd_gluon` does.
    """
    return _launch(q, k, v, v_new, h, dh, do, du, G, beta, A_inv, scale, index, group,
                   g_dtype, dq, dk, dv, dbeta, dg, sum_group=group > 1,
                   spend_states=spend_states)


def _launch(q, k, v, v_new, h, dh, do, du, G, beta, A_inv, scale, index, group, g_dtype,
            dq, dk, dv, dbeta, dg, *, sum_group: bool, spend_states: bool = False):
    outs, ready = prepare_launch(q, k, v, v_new, h, dh, do, du, G, beta, A_inv, index, group,
                                 g_dtype, dq, dk, dv, dbeta, dg, sum_group)
    if ready is not None:
        descs, G, beta = ready
        HV = v.shape[1]
        accs = _running_sums(h, dh, index.num_chunks, HV, group, spend_states) if sum_group \
            else (outs[0], outs[1], 0, 0)
        _CHUNK_GRADS_BWD_GLUON_KERNEL[(index.num_chunks, HV // group if sum_group else HV)](
            *descs.values(), G, beta, *outs, index.chunk_start, index.chunk_len,
            float(scale), HV, *accs, GROUP=group, K=_K, V=_V, BT=_BT,
            num_warps=GLUON_CHUNK_GRADS_WARPS, SUM_GROUP=sum_group,
        )
    return outs


def _running_sums(h: torch.Tensor, dh: torch.Tensor, NT: int, HV: int, group: int,
                  spend: bool) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(dq_acc, dk_acc, chunk stride, head stride)`` of the group's running fp32 sums, a
    ``[64, 128]`` fp32 tile per (chunk, q/k head), strides in fp32 elements: ``h``'s and
    ``dh``'s storage where ``spend`` (each ``[128, 128]`` 16-bit tile is one such fp32
    tile; a group's first value head's tile), else two fresh buffers."""
    tile = _BT * _K
    if spend and h.is_contiguous() and dh.is_contiguous():
        return h.view(torch.float32), dh.view(torch.float32), HV * tile, group * tile
    H = HV // group
    return (torch.empty(NT, H, tile, dtype=torch.float32, device=h.device),
            torch.empty(NT, H, tile, dtype=torch.float32, device=h.device), H * tile, tile)
