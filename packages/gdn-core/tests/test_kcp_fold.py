"""The fold: fixed-order IEEE fp32; the Triton kernels agree with the torch loop to fp32
rounding, and give the same bits whichever call (fold_step or any step of fold_chain,
alone or batched with other chains and heads) computes a step."""

from __future__ import annotations

import pytest
import torch
from gdn_core.kcp import fold
from gdn_core.kcp.fold import fold_chain, fold_step


def _interpreted() -> bool:
    return type(fold._kcp_fold_kernel).__name__ == "InterpretedFunction"


def _data(HV, K, V, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(HV, K, K, generator=gen, dtype=dtype),
            torch.randn(HV, K, V, generator=gen, dtype=dtype),
            torch.randn(HV, K, V, generator=gen, dtype=dtype))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("HV,K,V", [(1, 16, 16), (3, 48, 32), (2, 32, 80)])
def test_fold_matches_float64(HV, K, V, transpose):
    M, S, E = _data(HV, K, V)
    got = fold_step(M, S, E, transpose=transpose, impl="torch")
    Md = M.double().transpose(1, 2) if transpose else M.double()
    want = Md @ S.double() + E.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    no_e = fold_step(M, S, transpose=transpose, impl="torch")
    torch.testing.assert_close(no_e.double(), Md @ S.double(), rtol=1e-5, atol=1e-5)


def test_fold_is_the_documented_order():
    """acc = 0; acc = acc + M[:, j] ⊗ S[j, :] for j in order; + E — exactly."""
    M, S, E = _data(2, 16, 16, seed=1)
    acc = torch.zeros_like(S)
    for j in range(16):
        acc = acc + M[:, :, j, None] * S[:, None, j, :]
    assert torch.equal(fold_step(M, S, E, impl="torch"), acc + E)


def test_fold_ignores_matmul_precision_settings():
    M, S, E = _data(2, 32, 32, seed=2)
    before = fold_step(M, S, E)
    prec = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert torch.equal(fold_step(M, S, E), before)
    finally:
        torch.set_float32_matmul_precision(prec)


needs_interpreter = pytest.mark.skipif(
    not _interpreted(), reason="needs the Triton interpreter (TRITON_INTERPRET=1 before "
    "gdn_core.kcp.fold is imported) or a GPU test")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_interpreter
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("HV,K,V", [(1, 16, 16), (2, 48, 40), (1, 32, 80), (1, 128, 24)])
def test_triton_fold_matches_the_torch_fold(HV, K, V, transpose):
    """The tiled fp32 dots are not the rank-1 loop's bits, but its value to fp32 rounding."""
    M, S, E = _data(HV, K, V, seed=3)
    Md = M.double().transpose(1, 2) if transpose else M.double()
    for e in (E, None):
        a = fold_step(M, S, e, transpose=transpose, impl="torch")
        b = fold_step(M, S, e, transpose=transpose, impl="triton")
        want = Md @ S.double() + (e.double() if e is not None else 0)
        assert _rel(b, a) < 1e-5 and _rel(b, want) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("transpose", [False, True])
def test_triton_fold_step_is_head_invariant(transpose):
    """A head's bits do not depend on the other heads of the launch."""
    M, S, E = _data(3, 48, 24, seed=4)
    both = fold_step(M, S, E, transpose=transpose, impl="triton")
    alone = fold_step(M[1:2].clone(), S[1:2].clone(), E[1:2].clone(), transpose=transpose,
                      impl="triton")
    assert torch.equal(both[1:2], alone)


def _chain_pool(P, HV, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(P, HV, K, V + K, generator=gen) * 0.3
    return pool[..., :V], pool[..., V:], torch.randn(2, HV, K, V, generator=gen)


@needs_interpreter
@pytest.mark.parametrize("transpose", [False, True])
def test_triton_fold_chain_is_batch_invariant(transpose):
    """A chain's bits are fold_step's at every step, and do not depend on how many
    other chains (of other lengths, with copy steps) share the launch, nor on its
    place among them."""
    P, HV, K, V = 8, 2, 32, 24
    E, M, seeds = _chain_pool(P, HV, K, V, seed=6)
    # chain A: seed row 0, items 0,1,2 -> rows 1,2,3
    A = ([0, 1, 2], [0, 1, 2], [1, 2, 3])

    def launch(chains, impl="triton"):
        out = torch.zeros(12, HV, K, V)
        out[0], out[4] = seeds[0], seeds[1]
        items, prev, dst, ptr = [], [], [], [0]
        for it, pv, ds in chains:
            items += it
            prev += pv
            dst += ds
            ptr.append(len(items))
        return fold_chain(E, M, out, items, prev, dst, ptr, transpose=transpose, impl=impl)

    alone = launch([A])
    B = ([3, 4], [4, 5], [5, 6])                 # from seed row 4
    C = ([5, 6, 7, 0], [-1, 7, 8, 9], [7, 8, 9, 10])  # starts with a copy of E[5]
    crowd = launch([B, A, C])
    for r in A[2]:
        assert torch.equal(crowd[r], alone[r])
    steps = torch.zeros(4, HV, K, V)
    steps[0] = seeds[0]
    for it, pv, ds in zip(*A):
        steps[ds] = fold_step(M[it].contiguous(), steps[pv], E[it].contiguous(),
                              transpose=transpose, impl="triton")
    assert torch.equal(alone[:4], steps)
    assert _rel(crowd, launch([B, A, C], impl="torch")) < 1e-5  # the torch fold's value


def _gpu_close_and_tf32_immune(M, S, E, transpose):
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        plain = fold_step(M.cuda(), S.cuda(), E.cuda(), transpose=transpose)
        torch.backends.cuda.matmul.allow_tf32 = True
        got = fold_step(M.cuda(), S.cuda(), E.cuda(), transpose=transpose)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert torch.equal(got, plain)
    Md = M.double().transpose(1, 2) if transpose else M.double()
    assert _rel(got.cpu(), Md @ S.double() + E.double()) < 1e-5
    return got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("HV,K,V", [(8, 128, 128), (4, 256, 256), (2, 48, 80)])
def test_gpu_triton_fold_is_close_and_chain_bits(HV, K, V, transpose):
    """The CUDA fold: the fp64 fold's value to fp32 rounding, whatever the TF32
    settings; a one-step chain and a step batched with another chain give the same
    bits as fold_step."""
    M, S, E = _data(HV, K, V, seed=5)
    got = _gpu_close_and_tf32_immune(M, S, E, transpose)
    E2, M2, seeds = _chain_pool(3, HV, K, V, seed=7)
    pool_E = torch.stack([E, E2[0], E2[1]]).cuda()
    pool_M = torch.stack([M, M2[0], M2[1]]).cuda()
    out = torch.zeros(5, HV, K, V, device="cuda")
    out[0], out[2] = S.cuda(), seeds[0].cuda()
    one = fold_chain(pool_E, pool_M, out.clone(), [0], [0], [1], [0, 1], transpose=transpose)
    assert torch.equal(one[1], got)
    two = fold_chain(pool_E, pool_M, out.clone(), [1, 2, 0], [2, 3, 0], [3, 4, 1], [0, 2, 3],
                     transpose=transpose)
    assert torch.equal(two[1], got)
