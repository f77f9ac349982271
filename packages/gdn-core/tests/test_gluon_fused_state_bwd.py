"""The fused state-backward launcher without a GPU: it imports, it is declared atomic-free,
it refuses what it does not serve (``ValueError``) and devices it cannot run on
(``RuntimeError``) before compiling anything; the ``fused_state`` stage is a default taken
where a launch has enough programs, or wherever it is named (an unknown name still raises;
off the GPU the pair stays). The kernel itself: ``test_gluon_fused_state_bwd_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import gluon
from gdn_core.ops.gluon import fused_state_bwd as fs


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, w_dtype=None, N=1,
          chunk=64):
    index = ChunkIndex.build([0] + [T * (i + 1) // N for i in range(N)], "cpu",
                             chunk_size=chunk)
    HV = H * group
    q = torch.zeros(T, H, K, dtype=dtype)
    W = torch.zeros(T, HV, K, dtype=w_dtype or dtype)
    do = torch.zeros(T, HV, V, dtype=dtype)
    return [q, q.clone(), W, torch.zeros(T, HV), do, torch.zeros(index.num_docs, HV, K, V),
            0.5, index, group]


def test_declared_atomic_free():
    info = fs.fused_state_bwd_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (fs._fused_state_bwd_gluon_kernel,)


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(w_dtype=torch.float16), dict(chunk=32)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    args = _args(**kw)
    assert not fs.gluon_fused_state_supported(args[0], args[2], args[4], args[7])
    with pytest.raises(ValueError):
        fs.fused_state_bwd_gluon(*args)


def test_mismatched_shapes_and_buffers_raise_value_error():
    args = _args(N=2)
    bad = list(args)
    bad[5] = args[5][:1]  # dht of too few documents
    with pytest.raises(ValueError, match="shape mismatch"):
        fs.fused_state_bwd_gluon(*bad)
    bad = list(args)
    bad[4] = args[4].half()  # do in another 16-bit dtype
    with pytest.raises(ValueError, match="16-bit"):
        fs.fused_state_bwd_gluon(*bad)
    T, HV, V = args[4].shape
    K, NT, N = args[0].shape[2], args[7].num_chunks, args[7].num_docs
    with pytest.raises(ValueError, match="need must be"):
        fs.fused_state_bwd_gluon(*args, need=torch.ones(N, dtype=torch.int64))
    for kw in ({"dh": torch.empty(NT, HV, K, V)},
               {"dv": torch.empty(T, HV, 2 * V, dtype=torch.bfloat16)[..., :V]},
               {"dh0": torch.empty(N, HV, K, V, dtype=torch.float64)}):
        with pytest.raises(ValueError, match="must be a contiguous"):
            fs.fused_state_bwd_gluon(*args, **kw)


@pytest.mark.parametrize("store, stages", [(True, 1), (True, 3), (False, 1), (False, 4)])
def test_ring_depths_it_cannot_hold_raise_value_error(monkeypatch, store, stages):
    """A ring of fewer than 2 stages, or more than the shared memory holds (2 with the
    ``dh``/``dV'`` staging tiles, 3 without), is refused before anything else."""
    name = "GLUON_FUSED_STATE_STAGES" if store else "GLUON_FUSED_STATE_FIRST_PASS_STAGES"
    monkeypatch.setattr(fs, name, stages)
    with pytest.raises(ValueError, match="stages"):
        fs.fused_state_bwd_gluon(*_args(), store=store)


def test_cpu_tensors_raise_runtime_error():
    args = _args()
    assert fs.gluon_fused_state_supported(args[0], args[2], args[4], args[7])
    with pytest.raises(RuntimeError):
        fs.fused_state_bwd_gluon(*args)
    with pytest.raises(RuntimeError):
        fs.fused_state_bwd_gluon(*args, store=False)


def test_stage_is_registered_and_a_default(monkeypatch):
    """A default stage (``requested`` with the variable unset), but not ``named`` then: the
    shape rule of :func:`gdn_core.ops.backward.pick_fused_state` decides; named, it runs."""
    assert gluon.STAGES["fused_state"] == ("fused_state_bwd", "fused_state_bwd_gluon",
                                           "gluon_fused_state_supported")
    assert "fused_state" in gluon.DEFAULT_STAGES
    monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    assert gluon.requested("fused_state") and not gluon.named("fused_state")
    monkeypatch.setenv(gluon.GLUON_ENV, "fused_state")
    assert gluon.requested("fused_state") and not gluon.requested("grads")
    assert gluon.named("fused_state")
    monkeypatch.setenv(gluon.GLUON_ENV, " grads , fused_state ")
    assert gluon.named("fused_state") and not gluon.named("state_bwd")
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    assert not gluon.named("fused_state") and not gluon.named("grads")
    monkeypatch.setenv(gluon.GLUON_ENV, "fused_stat")
    with pytest.raises(ValueError, match="unknown stage"):
        gluon.requested("fused_state")


def test_the_default_takes_the_fused_kernel_only_with_enough_programs():
    """Unasked, the fused state backward runs only where (segments × value heads) reach
    FUSED_STATE_MIN_PROGRAMS (96): B1 T8192 H16 in segments of 4096 (32 programs) keeps the
    pair, B1 T32768 H16 (128) and 8 documents (192) take the fused kernel."""
    from gdn_core.ops.backward import FUSED_STATE_MIN_PROGRAMS, fused_state_pays

    assert FUSED_STATE_MIN_PROGRAMS == 96
    assert not fused_state_pays(2, 16) and not fused_state_pays(95, 1)
    assert fused_state_pays(8, 16) and fused_state_pays(12, 16) and fused_state_pays(3, 32)


def test_pick_follows_the_rule_unless_named(monkeypatch):
    """pick_fused_state: unset → the rule; named → the fused launcher whatever the size;
    ``none`` or another stage list → the pair (``None``). Gluon's pick is stubbed to
    "available" (CPU tensors), so only the routing is checked here."""
    from gdn_core.ops import backward

    monkeypatch.setattr(backward.gluon, "pick",
                        lambda stage, fallback, *probe: "fused" if backward.gluon.requested(
                            stage) else fallback)
    args = _args()
    q, W, do, index = args[0], args[2], args[4], args[7]
    small = index.num_docs * do.shape[1] < backward.FUSED_STATE_MIN_PROGRAMS
    assert small
    monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    assert backward.pick_fused_state(q, W, do, index) is None
    monkeypatch.setattr(backward, "FUSED_STATE_MIN_PROGRAMS", 1)
    assert backward.pick_fused_state(q, W, do, index) == "fused"
    monkeypatch.setattr(backward, "FUSED_STATE_MIN_PROGRAMS", 96)
    monkeypatch.setenv(gluon.GLUON_ENV, "fused_state")
    assert backward.pick_fused_state(q, W, do, index) == "fused"
    for value in ("none", "grads", "all"):
        monkeypatch.setenv(gluon.GLUON_ENV, value)
        assert backward.pick_fused_state(q, W, do, index) is None, value


def test_cpu_keeps_the_pair(monkeypatch):
    """Asked for on CPU tensors, the stage is not picked (the backward keeps dv_local +
    state_bwd): pick hands back the caller's fallback, here ``None``."""
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    args = _args()
    assert gluon.pick("fused_state", None, args[0], args[2], args[4], args[7]) is None


def test_all_leaves_out_the_stages_run_by_name_only(monkeypatch):
    """``GDN_CORE_GLUON=all`` does not ask for a stage of :data:`BY_NAME_ONLY` (the fused
    state backward supersedes two stages ``all`` runs); naming it does."""
    from gdn_core.ops import gluon

    assert "fused_state" in gluon.BY_NAME_ONLY
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    assert gluon.requested("state_bwd") and not gluon.requested("fused_state")
    monkeypatch.setenv(gluon.GLUON_ENV, "fused_state")
    assert gluon.requested("fused_state") and not gluon.requested("state_bwd")
