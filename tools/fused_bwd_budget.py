"""Register budgets for step 2 of docs/fused_backward.md, compiled for sm_90a without a GPU.

Step 2 puts the reverse state recurrence and every chunk gradient in one warp-specialised
CTA, and the register file (65,536 a CTA at one CTA per SM) decides how the work can be
split. Three compile probes (Triton 3.6's Gluon; the figures are ptxas's, from
``tools/sm90_report.py``)::

    PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/fused_bwd_budget.py [state|tail|grads]

* ``state``: the state partition at ONE warpgroup (4 warps) holding the whole 128×128 fp32
  ``−dSᵀ`` as its wgmma accumulator, every operand from shared memory
  (``acc = γ·acc + (−dos)ᵀ Q + dUᵀ W``, ``dS16 = round(−acc)`` published to a shared tile),
  beside a 4-warp partner that forms ``dU = K·dS16`` from it, the partner at 168 / 160 /
  152 registers and the state partition at 168 / 192 / 216.
* ``tail``: the same state partition beside a 4-warp partition running the design's
  partition-K tail (§2.4): two live ``[64, 128]`` fp32 accumulators (``acc``, ``dks``) and
  the ``k``-row sums of dg and dβ.
* ``grads``: today's one-tile chunk-gradient kernel
  (:mod:`gdn_core.ops.gluon.chunk_grads`, 8 warps: two warpgroups splitting every
  product's columns) under register caps of 200 / 168 / 160 / 152.

What they showed (session 18): ``state`` fits 168 registers without a spill; ``tail``
spills 124 / 424 / 388 B a thread with its partition at 168 / 160 / 152 (a 64×128 fp32
accumulator is 64 registers a thread at 4 warps, so two plus a ``k`` tile do not fit);
``grads`` spills 44 / 124 / 184 / 208 B at caps of 200 / 168 / 160 / 152. So a split that
fills the file exactly — the state 4 warps × 168, today's chunk-gradient statements on
8 warps × 160, a 4-warp producer × 24 — keeps the gradients' code (and their bits) with
modest spills, where the design's two 4-warp gradient partitions do not fit. The probes'
kernels are not launched anywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gdn_core.ops.gluon.lang import (  # noqa: E402
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from gdn_core.ops.gluon.tma import descriptor  # noqa: E402
from sm90_report import gluon_grads_args, report_gluon, setmaxnreg  # noqa: E402

BT, K, V = 64, 128, 128


@gluon.jit
def _state_part(q_s, w_s, dos_s, du_s, ds16_s, ready, done, G, n_chunks, dh0,
                K: gl.constexpr, V: gl.constexpr):
    """``−dSᵀ`` ``[V, K]`` fp32 in one warpgroup; ``(−dos)ᵀ Q`` and ``dUᵀ W`` from shared
    tiles; ``round(−acc)`` published to ``ds16_s``."""
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                instr_shape=[16, K, 16])
    acc = gl.zeros([V, K], gl.float32, L)
    for it in range(n_chunks):
        mbarrier.wait(ready, it & 1)
        acc = acc * gl.exp(gl.load(G + it))
        acc = warpgroup_mma(dos_s.permute((1, 0)), q_s, acc, is_async=True)
        acc = warpgroup_mma(du_s.permute((1, 0)), w_s, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc, dos_s, q_s, du_s, w_s])[0]
        ds16_s.store((-acc).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(done, count=1)
    rv = gl.arange(0, V, layout=gl.SliceLayout(1, L))
    ck = gl.arange(0, K, layout=gl.SliceLayout(0, L))
    gl.store(dh0 + ck[None, :] * V + rv[:, None], -acc)


@gluon.jit
def _du_part(k_s, ds16_s, du_s, ready, done, n_chunks, BT: gl.constexpr, V: gl.constexpr):
    """``dU = round(K · dS16)`` for the state partition (a minimal partner)."""
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                instr_shape=[16, V, 16])
    for it in range(n_chunks):
        mbarrier.wait(done, (it & 1) ^ 1, pred=it > 0)
        x = warpgroup_mma(k_s, ds16_s.permute((1, 0)), gl.zeros([BT, V], gl.float32, L),
                          use_acc=False, is_async=True)
        x = warpgroup_mma_wait(0, deps=[x, k_s, ds16_s])[0]
        du_s.store(x.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready, count=1)


@gluon.jit
def _tail_part(k_s, q_s, vn_s, ds16_s, a_s, dw_s, e_s, eb_s, ds_s, kd_ptr, b_ptr, g_ptr, dk,
               rows_out, ready, done, n_chunks, BT: gl.constexpr, K: gl.constexpr):
    """The design's partition-K tail: ``Γ Tᵀ dW`` (k·), ``+ E' K`` (k·C), ``β ⊙ · +
    (βE')ᵀ K``, ``dks = kd ⊙ V' dS16ᵀ`` (k·), ``+ dsᵀ Q`` = dK stored."""
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                instr_shape=[16, K, 16])
    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, K, layout=gl.SliceLayout(0, L))
    for it in range(n_chunks):
        mbarrier.wait(ready, it & 1)
        kd = gl.load(kd_ptr + it * BT + rows)
        b = gl.load(b_ptr + it * BT + rows)
        gam = gl.exp(gl.load(g_ptr + it * BT + rows))
        z = gl.zeros([BT, K], gl.float32, L)
        acc = warpgroup_mma(a_s.permute((1, 0)), dw_s, z, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc, a_s, dw_s])[0] * gam[:, None]
        wr = gl.sum(acc * k_s.load(L).to(gl.float32), axis=1)
        acc = warpgroup_mma(e_s, k_s, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc, e_s, k_s])[0]
        dbc = gl.sum(acc * k_s.load(L).to(gl.float32), axis=1)
        acc = warpgroup_mma(eb_s.permute((1, 0)), k_s, acc * b[:, None], is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc, eb_s, k_s])[0]
        dks = warpgroup_mma(vn_s, ds16_s.permute((1, 0)), z, use_acc=False, is_async=True)
        dks = warpgroup_mma_wait(0, deps=[dks, vn_s, ds16_s])[0] * kd[:, None]
        kds = gl.sum(k_s.load(L).to(gl.float32) * dks, axis=1)
        acc = warpgroup_mma(ds_s.permute((1, 0)), q_s, acc + dks, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc, ds_s, q_s])[0]
        gl.store(dk + (it * BT + rows)[:, None] * K + cols[None, :], acc.to(gl.bfloat16))
        gl.store(rows_out + it * BT + rows, wr + dbc + kds)
        gl.thread_barrier()
        mbarrier.arrive(done, count=1)


@gluon.jit
def _budget_kernel(t_desc, a_desc, kd_ptr, b_ptr, g_ptr, dk, rows_out, G, dh0, n_chunks,
                   TAIL: gl.constexpr, PARTNER_REGS: gl.constexpr):
    BT: gl.constexpr = 64
    K: gl.constexpr = 128
    V: gl.constexpr = 128
    tile: gl.constexpr = t_desc.layout
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], tile)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], tile)
    w_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], tile)
    dos_s = gl.allocate_shared_memory(gl.bfloat16, [BT, V], tile)
    du_s = gl.allocate_shared_memory(gl.bfloat16, [BT, V], tile)
    ds16_s = gl.allocate_shared_memory(
        gl.bfloat16, [V, K], gl.NVMMASharedLayout.get_default_for([V, K], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(done, count=1)
    fence_async_shared()
    if TAIL:
        vn_s = gl.allocate_shared_memory(gl.bfloat16, [BT, V], tile)
        dw_s = gl.allocate_shared_memory(gl.bfloat16, [BT, V], tile)
        a_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], a_desc.layout)
        e_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], a_desc.layout)
        eb_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], a_desc.layout)
        ds_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], a_desc.layout)
        gl.warp_specialize([
            (_state_part, (q_s, w_s, dos_s, du_s, ds16_s, ready, done, G, n_chunks, dh0, K, V)),
            (_tail_part, (k_s, q_s, vn_s, ds16_s, a_s, dw_s, e_s, eb_s, ds_s, kd_ptr, b_ptr,
                          g_ptr, dk, rows_out, ready, done, n_chunks, BT, K)),
        ], [4], [PARTNER_REGS])
    else:
        gl.warp_specialize([
            (_state_part, (q_s, w_s, dos_s, du_s, ds16_s, ready, done, G, n_chunks, dh0, K, V)),
            (_du_part, (k_s, ds16_s, du_s, ready, done, n_chunks, BT, V)),
        ], [4], [PARTNER_REGS])


def partitions(tail: bool) -> None:
    """``state`` (``tail=False``) or ``tail``: per kernel cap (8 warps: the two partitions'
    average) and partner budget; the state partition gets ``2·cap − partner``."""
    bf = torch.bfloat16
    f32 = torch.zeros(1024)
    args = dict(t_desc=descriptor(torch.zeros(1024, 16 * K, dtype=bf), [BT, K]),
                a_desc=descriptor(torch.zeros(1024, 16 * BT, dtype=bf), [BT, BT]),
                kd_ptr=f32, b_ptr=f32, g_ptr=f32, dk=torch.zeros(1024, K, dtype=bf),
                rows_out=f32, G=torch.zeros(64), dh0=torch.zeros(K, V), n_chunks=16)
    for cap, partner in ((168, 168), (176, 160), (184, 152)):
        print(f"{'tail' if tail else 'state'}: cap {cap}, partner {partner}, "
              f"state partition {2 * cap - partner}")
        out = report_gluon(_budget_kernel, args, dict(TAIL=tail, PARTNER_REGS=partner),
                           num_warps=4, maxnreg=cap)
        print("  setmaxnreg:", setmaxnreg(out["ptx"]))


def grads() -> None:
    """Today's one-tile chunk-gradient kernel (8 warps, bf16, K = V = 128, group 1) under
    register caps."""
    from gdn_core.ops.gluon import chunk_grads as gc

    args = gluon_grads_args(16, 16)
    for cap in (200, 168, 160, 152):
        print(f"grads: cap {cap}")
        report_gluon(gc._chunk_grads_bwd_gluon_kernel, args, dict(GROUP=1, K=K, V=V, BT=BT),
                     num_warps=gc.GLUON_CHUNK_GRADS_WARPS, maxnreg=cap)


if __name__ == "__main__":
    which = sys.argv[1:] or ["state", "tail", "grads"]
    for name in which:
        {"state": lambda: partitions(False), "tail": lambda: partitions(True),
         "grads": grads}[name]()
