"""The backward's one-launch recompute (``gdn_core.ops.gluon.recompute``) without a GPU: it
imports, it is declared atomic-free and a default stage (unset or named, not by ``all``,
which runs the Gluon ``wy_apply`` and state kernels instead), it refuses what it does not
serve (``ValueError``) and devices it cannot run on (``RuntimeError``) before compiling
anything, and CPU tensors keep the Triton pair. The kernel itself:
``test_gluon_recompute_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import gluon
from gdn_core.ops.gluon import recompute as rc


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, v_dtype=None,
          a_dtype=None):
    index = ChunkIndex.build([0, T], "cpu")
    HV = H * group
    return (torch.zeros(T, H, K, dtype=dtype), torch.zeros(T, HV, V, dtype=v_dtype or dtype),
            torch.zeros(T, HV, dtype=dtype), torch.zeros(T, HV),
            torch.zeros(T, HV, 64, dtype=a_dtype or dtype), index, group)


def test_declared_atomic_free_and_a_default(monkeypatch):
    info = rc.chunk_recompute_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (rc._recompute_gluon_kernel,)
    assert "recompute" in gluon.BY_NAME_ONLY and "recompute" in gluon.DEFAULT_STAGES
    monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    assert gluon.requested("recompute")
    monkeypatch.setenv(gluon.GLUON_ENV, "grads,wy")
    assert not gluon.requested("recompute")
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    assert not gluon.requested("recompute")
    monkeypatch.setenv(gluon.GLUON_ENV, "recompute")
    assert gluon.requested("recompute")


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(v_dtype=torch.float16), dict(a_dtype=torch.float32)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    k, v, _, _, A_inv, index, _ = args
    assert not rc.gluon_recompute_supported(k, v, A_inv, index)
    with pytest.raises(ValueError):
        rc.chunk_recompute_gluon(*args)


def test_mismatched_shapes_and_initial_state_raise_value_error():
    k, v, beta, G, A_inv, index, group = _args()
    with pytest.raises(ValueError, match="shape mismatch"):
        rc.chunk_recompute_gluon(k, v[:-1], beta, G, A_inv, index, group)
    with pytest.raises(ValueError, match="shape mismatch"):
        rc.chunk_recompute_gluon(k, v, beta, G, A_inv, index, group + 1)
    with pytest.raises(ValueError, match="A_inv must be"):
        rc.chunk_recompute_gluon(k, v, beta, G, A_inv[:, :, :32], index, group)
    with pytest.raises(ValueError, match="initial_state"):
        rc.chunk_recompute_gluon(k, v, beta, G, A_inv, index, group,
                                 initial_state=torch.zeros(1, 2, 128, 64))


def test_other_chunk_size_raises_value_error():
    k, v, beta, G, A_inv, _, group = _args(T=64)
    index = ChunkIndex.build([0, 64], "cpu", chunk_size=32)
    with pytest.raises(ValueError, match="chunks of 64"):
        rc.chunk_recompute_gluon(k, v, beta, G, A_inv, index, group)


def test_cpu_tensors_raise_runtime_error():
    with pytest.raises(RuntimeError):
        rc.chunk_recompute_gluon(*_args())


def test_pick_keeps_the_triton_pair_on_the_cpu(monkeypatch):
    """Named, the stage still serves CUDA tensors only: CPU inputs get ``None`` (the caller
    runs ``wy_apply`` and the state pass), never the Gluon launcher."""
    monkeypatch.setenv(gluon.GLUON_ENV, "recompute")
    k, v, _, _, A_inv, index, _ = _args()
    assert gluon.pick("recompute", None, k, v, A_inv, index) is None
