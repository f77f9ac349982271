"""The fold: fixed-order IEEE fp32, equal bits from the torch loop and the Triton kernel."""

from __future__ import annotations

import pytest
import torch
from gdn_core.kcp import fold
from gdn_core.kcp.fold import fold_step


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


@pytest.mark.skipif(not _interpreted(), reason="needs the Triton interpreter (TRITON_INTERPRET=1 "
                    "before gdn_core.kcp.fold is imported) or a GPU test")
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("HV,K,V", [(1, 16, 16), (2, 48, 40), (1, 32, 80)])
def test_triton_fold_is_bitwise_the_torch_fold(HV, K, V, transpose):
    M, S, E = _data(HV, K, V, seed=3)
    a = fold_step(M, S, E, transpose=transpose, impl="torch")
    b = fold_step(M, S, E, transpose=transpose, impl="triton")
    assert torch.equal(a, b)
    assert torch.equal(fold_step(M, S, transpose=transpose, impl="torch"),
                       fold_step(M, S, transpose=transpose, impl="triton"))


def test_fold_float64_and_errors():
    M, S, E = _data(1, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(fold_step(M, S, E), M @ S + E, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError):
        fold_step(M, S, E, impl="triton")
    with pytest.raises(ValueError):
        fold_step(M, S[:, :8], E)
    with pytest.raises(ValueError):
        fold_step(M, S, E, impl="cublas")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("HV,K,V", [(8, 128, 128), (4, 256, 256), (2, 48, 80)])
def test_gpu_triton_fold_is_bitwise_the_cpu_fold(HV, K, V, transpose):
    """The CUDA kernel (no FMA contraction) reproduces the CPU torch loop bit for bit,
    whatever the TF32 settings."""
    M, S, E = _data(HV, K, V, seed=5)
    want = fold_step(M, S, E, transpose=transpose, impl="torch")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        got = fold_step(M.cuda(), S.cuda(), E.cuda(), transpose=transpose)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert torch.equal(got.cpu(), want)
