"""The Gluon chunk-output launcher without a GPU: it imports, it is declared atomic-free,
and it refuses what it does not serve (``ValueError``) and devices it cannot run on
(``RuntimeError``) before compiling anything. The kernel itself: ``*_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops.gluon import output as go


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16):
    index = ChunkIndex.build([0, T], "cpu")
    HV = H * group
    q = torch.zeros(T, H, K, dtype=dtype)
    return (q, q.clone(), torch.zeros(T, HV, V, dtype=dtype),
            torch.zeros(index.num_chunks, HV, K, V, dtype=dtype), torch.zeros(T, HV), 0.5,
            index, group)


def test_declared_atomic_free():
    info = go.chunk_output_fwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (go._chunk_output_fwd_gluon_kernel,)


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not go.gluon_output_supported(args[0], args[2], args[3], args[6])
    with pytest.raises(ValueError):
        go.chunk_output_fwd_gluon(*args)


def test_mismatched_shapes_and_dtypes_raise_value_error():
    q, k, v_new, h, G, scale, index, group = _args()
    with pytest.raises(ValueError, match="shape mismatch"):
        go.chunk_output_fwd_gluon(q, k, v_new, h[:-1], G, scale, index, group)
    with pytest.raises(ValueError, match="16-bit"):
        go.chunk_output_fwd_gluon(q, k, v_new.half(), h, G, scale, index, group)


def test_cpu_tensors_raise_runtime_error():
    args = _args()
    assert go.gluon_output_supported(args[0], args[2], args[3], args[6])
    with pytest.raises(RuntimeError):
        go.chunk_output_fwd_gluon(*args)
