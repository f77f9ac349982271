"""The warp-specialised Gluon fused forward (``gdn_core.ops.gluon.fused_fwd``) without a
GPU: it imports, it is declared atomic-free and a default stage that ``all`` leaves out
(``all`` means the unfused forward's Gluon stages), it refuses what it does not serve
(``ValueError``) and devices it cannot run on (``RuntimeError``) before compiling anything,
and the forward asks for it only where the Triton fused forward runs. The kernel itself:
``test_gluon_fused_fwd_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import gluon
from gdn_core.ops.chunk_fwd_fused import chunk_fwd_fused
from gdn_core.ops.gluon import fused_fwd as ff


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, u_dtype=None):
    index = ChunkIndex.build([0, T], "cpu")
    HV = H * group
    return (torch.zeros(T, H, K, dtype=dtype), torch.zeros(T, H, K, dtype=dtype),
            torch.zeros(T, HV, K, dtype=dtype), torch.zeros(T, HV, V, dtype=u_dtype or dtype),
            torch.zeros(T, HV), 0.5, index, group)


def test_declared_atomic_free_default_and_left_out_of_all(monkeypatch):
    info = ff.chunk_fwd_fused_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (ff._fused_fwd_gluon_kernel,)
    assert "fused_fwd" in gluon.BY_NAME_ONLY and "fused_fwd" in gluon.DEFAULT_STAGES
    monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    assert gluon.requested("fused_fwd")
    monkeypatch.setenv(gluon.GLUON_ENV, "grads")
    assert not gluon.requested("fused_fwd")
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    assert not gluon.requested("fused_fwd")
    monkeypatch.setenv(gluon.GLUON_ENV, "fused_fwd")
    assert gluon.requested("fused_fwd")


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(u_dtype=torch.float16)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not ff.gluon_fused_fwd_supported(*args[:4], args[6])
    with pytest.raises(ValueError):
        ff.chunk_fwd_fused_gluon(*args)


def test_mismatched_shapes_and_initial_state_raise_value_error():
    q, k, W, U, G, scale, index, group = _args()
    with pytest.raises(ValueError, match="shape mismatch"):
        ff.chunk_fwd_fused_gluon(q, k, W[:-1], U, G, scale, index, group)
    with pytest.raises(ValueError, match="shape mismatch"):
        ff.chunk_fwd_fused_gluon(q, k, W, U, G, scale, index, group + 1)
    with pytest.raises(ValueError, match="initial_state"):
        ff.chunk_fwd_fused_gluon(q, k, W, U, G, scale, index, group,
                                 initial_state=torch.zeros(1, 2, 128, 64))


def test_other_chunk_size_raises_value_error():
    q, k, W, U, G, scale, _, group = _args(T=64)
    index = ChunkIndex.build([0, 64], "cpu", chunk_size=32)
    with pytest.raises(ValueError, match="chunks of 64"):
        ff.chunk_fwd_fused_gluon(q, k, W, U, G, scale, index, group)


def test_cpu_tensors_raise_runtime_error():
    with pytest.raises(RuntimeError):
        ff.chunk_fwd_fused_gluon(*_args())


def test_pick_keeps_the_triton_kernel_on_the_cpu(monkeypatch):
    """Named, the stage still serves CUDA tensors only: CPU inputs get the Triton kernel
    (the interpreter path), never the Gluon launcher."""
    monkeypatch.setenv(gluon.GLUON_ENV, "fused_fwd")
    q, k, W, U, _, _, index, _ = _args()
    assert gluon.pick("fused_fwd", chunk_fwd_fused, q, k, W, U, index) is chunk_fwd_fused
