"""Bits probe for step 2 of docs/fused_backward.md: does a ``warpgroup_mma`` give the same bits
whichever way its operands arrive? (GPU only, sm_90, Triton 3.6's Gluon.)

The step-2 state partition (one warpgroup holding the whole 128×128 fp32 state,
``tools/fused_bwd_budget.py``) takes every operand from shared memory and keeps the state
negated, where today's fused state kernel (two warpgroups) takes ``dos`` and ``−dV'ᵀ`` from
registers. For its ``dS`` to keep today's bits, all of these must hold; the probe computes
``C + A·B`` (A ``[M, 64]``, B ``[64, 128]`` bf16 with random values, C fp32) and prints
whether each variant is ``torch.equal`` to the first:

* A from registers (a dot-operand layout; today's kernels) — the baseline;
* A from a K-major shared tile;
* A from a shared tile holding ``Aᵀ``, ``permute``-d (MN-major: step 2's ``(−dos)ᵀ``);
* ``−((−A)·B + (−C))``: the negated accumulator (is the accumulation sign-symmetric?);
* M = 128 on one warpgroup (two m64 tiles a thread set) against two warpgroups;
* ``(Bᵀ·Aᵀ)ᵀ`` against ``A·B`` (step 2 forms ``X = K·dS16`` where today's kernel forms
  ``Xᵀ = dSᵀ Kᵀ``; M = 128, no C).

    python benchmarks/wgmma_operand_bits_probe.py [--trials 20]

Exit status 2 without an sm_90 GPU and Gluon, 1 if a variant differs, else 0.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _kernels():
    from gdn_core.ops.gluon.lang import (
        fence_async_shared,
        gl,
        gluon,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    @gluon.jit
    def _probe(a_ptr, b_ptr, c_ptr, out_ptr, M: gl.constexpr, WARPS: gl.constexpr):
        KD: gl.constexpr = 64
        N: gl.constexpr = 128
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, N, 16])
        AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
        IO: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[WARPS, 1], order=[1, 0])
        ra = gl.arange(0, M, layout=gl.SliceLayout(1, IO))
        ka = gl.arange(0, KD, layout=gl.SliceLayout(0, IO))
        rb = gl.arange(0, KD, layout=gl.SliceLayout(1, IO))
        nb = gl.arange(0, N, layout=gl.SliceLayout(0, IO))
        a = gl.load(a_ptr + ra[:, None] * KD + ka[None, :])
        b = gl.load(b_ptr + rb[:, None] * N + nb[None, :])
        rc = gl.arange(0, M, layout=gl.SliceLayout(1, L))
        nc = gl.arange(0, N, layout=gl.SliceLayout(0, L))
        offs = rc[:, None] * N + nc[None, :]
        c = gl.load(c_ptr + offs)
        a_s = gl.allocate_shared_memory(
            gl.bfloat16, [M, KD], gl.NVMMASharedLayout.get_default_for([M, KD], gl.bfloat16), a)
        na_s = gl.allocate_shared_memory(
            gl.bfloat16, [M, KD], gl.NVMMASharedLayout.get_default_for([M, KD], gl.bfloat16), -a)
        at_s = gl.allocate_shared_memory(
            gl.bfloat16, [KD, M], gl.NVMMASharedLayout.get_default_for([KD, M], gl.bfloat16),
            gl.permute(a, (1, 0)))
        b_s = gl.allocate_shared_memory(
            gl.bfloat16, [KD, N], gl.NVMMASharedLayout.get_default_for([KD, N], gl.bfloat16), b)
        fence_async_shared()
        gl.thread_barrier()
        x0 = warpgroup_mma(gl.convert_layout(a, AOP), b_s, c, is_async=True)
        x0 = warpgroup_mma_wait(0, deps=[x0, b_s])[0]
        gl.store(out_ptr + offs, x0)
        x1 = warpgroup_mma(a_s, b_s, c, is_async=True)
        x1 = warpgroup_mma_wait(0, deps=[x1, a_s, b_s])[0]
        gl.store(out_ptr + M * N + offs, x1)
        x2 = warpgroup_mma(at_s.permute((1, 0)), b_s, c, is_async=True)
        x2 = warpgroup_mma_wait(0, deps=[x2, at_s, b_s])[0]
        gl.store(out_ptr + 2 * M * N + offs, x2)
        x3 = warpgroup_mma(na_s, b_s, -c, is_async=True)
        x3 = warpgroup_mma_wait(0, deps=[x3, na_s, b_s])[0]
        gl.store(out_ptr + 3 * M * N + offs, -x3)

    return _probe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="random problems per shape")
    args = parser.parse_args(argv)
    from gdn_core.ops.gluon import available

    if not available():
        print("wgmma_operand_bits_probe: needs a CUDA sm_90 GPU and Triton 3.6's Gluon "
              f"(CUDA available: {torch.cuda.is_available()}); nothing run")
        return 2
    probe = _kernels()
    names = ("A in registers", "A K-major in shared", "A = (Aᵀ tile)ᵀ in shared",
             "−((−A)·B + (−C))")
    gen = torch.Generator(device="cuda").manual_seed(0)
    same = {(M, w, n): True for M, w in ((64, 4), (128, 4), (128, 8)) for n in names[1:]}
    warps_same = transposed_same = True
    for _ in range(args.trials):
        b = torch.randn(64, 128, generator=gen, device="cuda").bfloat16()
        a128 = torch.randn(128, 64, generator=gen, device="cuda").bfloat16()
        c128 = torch.randn(128, 128, generator=gen, device="cuda") * 4
        outs = {}
        for M, warps in ((64, 4), (128, 4), (128, 8)):
            out = torch.empty(4, M, 128, device="cuda")
            probe[(1,)](a128[:M].contiguous(), b, c128[:M].contiguous(), out, M=M, WARPS=warps,
                        num_warps=warps)
            outs[(M, warps)] = out
            for i, n in enumerate(names[1:], start=1):
                same[(M, warps, n)] &= torch.equal(out[i], out[0])
        warps_same &= torch.equal(outs[(128, 4)][0], outs[(128, 8)][0])
        zero = torch.zeros(128, 128, device="cuda")
        ab, ba = torch.empty(4, 128, 128, device="cuda"), torch.empty(4, 128, 128, device="cuda")
        probe[(1,)](a128, b, zero, ab, M=128, WARPS=8, num_warps=8)
        probe[(1,)](b.t().contiguous(), a128.t().contiguous(), zero, ba, M=128, WARPS=8,
                    num_warps=8)
        transposed_same &= torch.equal(ba[1].t(), ab[1])
    ok = all(same.values()) and warps_same and transposed_same
    for (M, warps, n), eq in same.items():
        print(f"M={M:3d} {warps} warps: {n:28s} vs A in registers: "
              f"{'bitwise equal' if eq else 'DIFFERENT'}")
    print(f"M=128: one warpgroup vs two: {'bitwise equal' if warps_same else 'DIFFERENT'}")
    print(f"(Bᵀ·Aᵀ)ᵀ vs A·B: {'bitwise equal' if transposed_same else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
