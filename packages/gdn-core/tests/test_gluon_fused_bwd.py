"""The fused backward's launcher without a GPU: it imports, it is declared atomic-free, it
refuses what it does not serve (``ValueError``) and devices
it cannot run on (``RuntimeError``) before compiling anything; the ``fused_bwd`` stage runs
by name only (not a default, not in ``all``), and the backward takes it only where it
serves the whole last phase. The kernel itself: ``test_gluon_fused_bwd_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import gluon
from gdn_core.ops.gluon import fused_bwd as fb


def _args(T=70, H=2, group=1, K=128, V=128, dtype=torch.bfloat16, w_dtype=None, N=1,
          chunk=64, a_dtype=None):
    index = ChunkIndex.build([0] + [T * (i + 1) // N for i in range(N)], "cpu",
                             chunk_size=chunk)
    HV = H * group
    q = torch.zeros(T, H, K, dtype=dtype)
    v = torch.zeros(T, HV, V, dtype=dtype)
    W = torch.zeros(T, HV, K, dtype=w_dtype or dtype)
    h = torch.zeros(index.num_chunks, HV, K, V, dtype=dtype)
    A = torch.zeros(T, HV, chunk, dtype=a_dtype or dtype)
    G = torch.zeros(T, HV)
    beta = torch.zeros(T, HV, dtype=dtype)
    dht = torch.zeros(index.num_docs, HV, K, V)
    return [q, q.clone(), v, v.clone(), h, W, v.clone(), G, beta, A, dht, 0.5, index,
            torch.float32]


def test_declared_atomic_free():
    info = fb.fused_bwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (fb._fused_bwd_gluon_kernel,)


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(a_dtype=torch.float16), dict(chunk=32)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not fb.gluon_fused_bwd_supported(args[0], args[2], args[9], args[12])
    with pytest.raises(ValueError):
        fb.fused_bwd_gluon(*args)


def test_grouped_value_heads_take_per_value_head_partials():
    """Grouped value heads are served (``dq``/``dk`` as ``[T, HV, K]`` partials for
    ``group_reduce``): a ``[T, H, K]`` buffer is refused, as is a value-head count that is
    not a multiple of the q/k heads."""
    args = _args(group=2)
    assert fb.gluon_fused_bwd_supported(args[0], args[2], args[9], args[12])
    T, H, K = args[0].shape
    with pytest.raises(ValueError, match=r"must be a contiguous \(70, 4, 128\)"):
        fb.fused_bwd_gluon(*args, dq=torch.empty(T, H, K))
    with pytest.raises(RuntimeError):  # the CPU: refused only after every check passed
        fb.fused_bwd_gluon(*args)
    bad = _args(H=2, group=1)
    bad[2] = bad[3] = bad[6] = torch.zeros(T, 3, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        fb.fused_bwd_gluon(*bad)


def test_mismatched_shapes_and_buffers_raise_value_error():
    args = _args(N=2)
    bad = list(args)
    bad[10] = args[10][:1]  # dht of too few documents
    with pytest.raises(ValueError, match="shape mismatch"):
        fb.fused_bwd_gluon(*bad)
    bad = list(args)
    bad[5] = args[5].half()  # W in another 16-bit dtype
    with pytest.raises(ValueError, match="16-bit"):
        fb.fused_bwd_gluon(*bad)
    T, H, K = args[0].shape
    N = args[12].num_docs
    with pytest.raises(ValueError, match="must be a contiguous"):
        fb.fused_bwd_gluon(*args, dq=torch.empty(T, H, 2 * K)[..., :K])
    with pytest.raises(ValueError, match="dh0 must be"):
        fb.fused_bwd_gluon(*args, dh0=torch.empty(N, H, K, K, dtype=torch.float64))


def test_cpu_tensors_raise_runtime_error():
    args = _args()
    assert fb.gluon_fused_bwd_supported(args[0], args[2], args[9], args[12])
    with pytest.raises(RuntimeError):
        fb.fused_bwd_gluon(*args)


def test_stage_runs_by_name_only(monkeypatch):
    assert gluon.STAGES["fused_bwd"] == ("fused_bwd", "fused_bwd_gluon",
                                         "gluon_fused_bwd_supported")
    assert "fused_bwd" in gluon.BY_NAME_ONLY and "fused_bwd" not in gluon.DEFAULT_STAGES
    monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    assert not gluon.requested("fused_bwd")
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    assert not gluon.requested("fused_bwd") and gluon.requested("grads")
    monkeypatch.setenv(gluon.GLUON_ENV, "grads,fused_bwd")
    assert gluon.requested("fused_bwd") and gluon.named("fused_bwd")


def test_pick_takes_it_only_for_the_whole_last_phase(monkeypatch):
    """:func:`gdn_core.ops.backward.pick_fused_bwd`: the launcher where the stage is asked
    for and the backward runs whole (no ``dv_local`` handed in, no workspace, no result
    buffers, the recomputed tensors in q's dtype); ``None`` otherwise. Gluon's pick is
    stubbed to "available" (CPU tensors), so only the routing is checked here."""
    from gdn_core.ops import backward

    monkeypatch.setattr(backward.gluon, "pick",
                        lambda stage, fallback, *probe: "fused" if backward.gluon.requested(
                            stage) else fallback)
    a = _args()
    q, v, h, W, do, A, index = a[0], a[2], a[4], a[5], a[6], a[9], a[12]
    rec = backward.Recomputed(W, h, v.clone())
    free = dict(workspace=None, out=None, dv_local=None)
    monkeypatch.setenv(gluon.GLUON_ENV, "grads,fused_bwd")
    assert backward.pick_fused_bwd(q, v, A, index, rec, do, **free) == "fused"
    for kw in (dict(workspace=object()), dict(out=(v,)), dict(dv_local=v)):
        assert backward.pick_fused_bwd(q, v, A, index, rec, do, **{**free, **kw}) is None, kw
    half = backward.Recomputed(W.half(), h, v)
    assert backward.pick_fused_bwd(q, v, A, index, half, do, **free) is None
    spent = backward.Recomputed(None, h, v)
    assert backward.pick_fused_bwd(q, v, A, index, spent, do, **free) is None
    monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    assert backward.pick_fused_bwd(q, v, A, index, rec, do, **free) is None


def test_cpu_keeps_the_two_kernels(monkeypatch):
    """Asked for on CPU tensors, the stage is not picked: pick hands back the fallback."""
    monkeypatch.setenv(gluon.GLUON_ENV, "fused_bwd")
    a = _args()
    assert gluon.pick("fused_bwd", None, a[0], a[2], a[9], a[12]) is None
