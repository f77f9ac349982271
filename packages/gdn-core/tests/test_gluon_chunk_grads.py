"""The Gluon chunk-gradient launcher without a GPU: it imports, it is declared atomic-free,
and it refuses what it does not serve (``ValueError``) and devices it cannot run on
(``RuntimeError``) before compiling anything. The kernel itself: ``*_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops.gluon import chunk_grads as gc


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, a_dtype=None):
    index = ChunkIndex.build([0, T], "cpu")
    HV, NT = H * group, index.num_chunks
    q = torch.zeros(T, H, K, dtype=dtype)
    v = torch.zeros(T, HV, V, dtype=dtype)
    h = torch.zeros(NT, HV, K, V, dtype=dtype)
    a = torch.zeros(T, HV, 64, dtype=a_dtype or dtype)
    return [q, q.clone(), v, v.clone(), h, h.clone(), v.clone(), v.clone(), torch.zeros(T, HV),
            torch.zeros(T, HV), a, 0.5, index, group, torch.float32]


def test_declared_atomic_free():
    info = gc.chunk_grads_bwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (gc._chunk_grads_bwd_gluon_kernel,)


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(a_dtype=torch.float32)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not gc.gluon_chunk_grads_supported(args[0], args[2], args[10], args[12])
    with pytest.raises(ValueError):
        gc.chunk_grads_bwd_gluon(*args)


def test_mismatched_shapes_and_dtypes_raise_value_error():
    args = _args()
    bad = list(args)
    bad[5] = args[5][:-1]  # dh of too few chunks
    with pytest.raises(ValueError, match="shape mismatch"):
        gc.chunk_grads_bwd_gluon(*bad)
    bad = list(args)
    bad[7] = args[7].half()  # du in another 16-bit dtype
    with pytest.raises(ValueError, match="16-bit"):
        gc.chunk_grads_bwd_gluon(*bad)
    T, HV = args[2].shape[:2]
    for kw in ({"dq": torch.empty(T, HV, 129)}, {"dk": torch.empty(T, HV, 256)[..., :128]}):
        with pytest.raises(ValueError, match="must be a contiguous"):
            gc.chunk_grads_bwd_gluon(*args, **kw)


def test_cpu_tensors_raise_runtime_error():
    args = _args()
    assert gc.gluon_chunk_grads_supported(args[0], args[2], args[10], args[12])
    with pytest.raises(RuntimeError):
        gc.chunk_grads_bwd_gluon(*args)
