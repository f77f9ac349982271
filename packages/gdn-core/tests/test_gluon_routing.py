"""GDN_CORE_GLUON: which stages ask for their Gluon kernel (unset: the default stages;
``none``: no stage), and that the pipeline keeps
the Triton kernel wherever the Gluon one does not serve (here: no GPU, or other shapes),
with the same bits as without the switch."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import gluon
from gdn_core.ops.chunk_grads_bwd import chunk_grads_bwd
from gdn_core.ops.output import chunk_output_fwd


@pytest.mark.parametrize("value, output, grads", [
    ("", False, True), (" ", False, True), ("none", False, False), (" none ", False, False),
    ("output", True, False), ("grads", False, True),
    (" output , grads ", True, True), ("all", True, True),
])
def test_requested(monkeypatch, value, output, grads):
    monkeypatch.setenv(gluon.GLUON_ENV, value)
    assert gluon.requested("output") is output and gluon.requested("grads") is grads


def test_unset_means_the_default_stages(monkeypatch):
    monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
    # fused_state where a launch has enough programs
    want = {"grads", "fused_state", "wy", "fused_fwd", "recompute"}
    assert {s for s in gluon.STAGES if gluon.requested(s)} == gluon.DEFAULT_STAGES == want


def test_none_with_stages_raises(monkeypatch):
    monkeypatch.setenv(gluon.GLUON_ENV, "none,grads")
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        gluon.requested("grads")


def test_unknown_stage_raises(monkeypatch):
    monkeypatch.setenv(gluon.GLUON_ENV, "output,grad")
    with pytest.raises(ValueError, match="unknown stage.*'grad'"):
        gluon.requested("output")


TRITON_LAUNCHERS = {
    "output": "gdn_core.ops.output:chunk_output_fwd",
    "grads": "gdn_core.ops.chunk_grads_bwd:chunk_grads_bwd",
    "wy": "gdn_core.ops.wy:wy_fwd",
    "state": "gdn_core.ops.chunk_state:chunk_state_fwd",
    "state_bwd": "gdn_core.ops.chunk_state_bwd:chunk_state_bwd",
    "wy_apply": "gdn_core.ops.wy:wy_apply",
    "dv_local": "gdn_core.ops.dv_local:dv_local_bwd",
    "grads2": "gdn_core.ops.chunk_grads_bwd:chunk_grads_bwd",
    # chunk_state_bwd's parameters less dv_local (computed inside)
    "fused_state": "gdn_core.ops.chunk_state_bwd:chunk_state_bwd",
    "fused_fwd": "gdn_core.ops.chunk_fwd_fused:chunk_fwd_fused",
    # wy_apply's parameters, then chunk_state_fwd's initial_state (checked below)
    "recompute": "gdn_core.ops.wy:wy_apply",
    # replaces two launchers: its parameters are theirs (checked below)
    "fused_bwd": "gdn_core.ops.chunk_grads_bwd:chunk_grads_bwd",
}


@pytest.mark.parametrize("stage", sorted(gluon.STAGES))
def test_every_stage_is_a_drop_in_for_its_triton_launcher(stage):
    """Each stage's Gluon launcher takes the Triton launcher's parameters (names, kinds,
    defaults) and is registered atomic-free; its ``supported`` test exists."""
    import importlib
    import inspect

    module, name, supported = gluon.STAGES[stage]
    mod = importlib.import_module(f"gdn_core.ops.gluon.{module}")
    tmod, tname = TRITON_LAUNCHERS[stage].split(":")
    triton_fn = getattr(importlib.import_module(tmod), tname)
    got = inspect.signature(getattr(mod, name)).parameters
    want = inspect.signature(triton_fn).parameters
    if stage == "fused_state":
        want = {n: p for n, p in want.items() if n != "dv_local"}
    if stage == "fused_bwd":  # the inputs of chunk grads and of the state backward, by name
        from gdn_core.ops.chunk_state_bwd import chunk_state_bwd

        state = inspect.signature(chunk_state_bwd).parameters
        both = {**state, **want}
        probe_only = {"stamps"}  # the timing probe's debug buffer, None by default
        assert all(got[n].default is None for n in probe_only)
        got = {n: p for n, p in got.items() if n not in probe_only}
        assert set(got) <= set(both), set(got) - set(both)
        assert all(both[n].default == p.default for n, p in got.items() if n != "dh0"), got
        assert set(got) >= {"q", "k", "v", "v_new", "h", "W", "do", "G", "beta", "A_inv",
                            "dht", "scale", "index", "g_dtype"}
        assert callable(getattr(mod, supported))
        assert getattr(mod, name).launcher_info.uses_atomics is False
        return
    if stage == "recompute":
        from gdn_core.ops.chunk_state import chunk_state_fwd

        init = inspect.signature(chunk_state_fwd).parameters["initial_state"]
        assert got["initial_state"].kind is inspect.Parameter.KEYWORD_ONLY  # passed by name
        assert got["initial_state"].default is init.default is None
        got = {n: p for n, p in got.items() if n != "initial_state"}
    assert [(p.name, p.kind, p.default) for p in got.values()] == \
        [(p.name, p.kind, p.default) for p in want.values()]
    assert callable(getattr(mod, supported))
    assert getattr(mod, name).launcher_info.uses_atomics is False


def test_cpu_and_other_shapes_keep_triton(monkeypatch):
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    index = ChunkIndex.build([0, 70], "cpu")
    q = torch.zeros(70, 1, 128, dtype=torch.bfloat16)
    v = torch.zeros(70, 1, 128, dtype=torch.bfloat16)
    h = torch.zeros(index.num_chunks, 1, 128, 128, dtype=torch.bfloat16)
    assert gluon.pick("output", chunk_output_fwd, q, v, h, index) is chunk_output_fwd  # CPU tensors
    A = torch.zeros(70, 1, 64, dtype=torch.bfloat16)
    assert gluon.pick("grads", chunk_grads_bwd, q, v, A, index) is chunk_grads_bwd
    if torch.cuda.is_available():  # on a GPU: K = 64 is not served by the Gluon kernels
        q64 = q[..., :64].contiguous().cuda()
        assert gluon.pick("output", chunk_output_fwd, q64, v.cuda(), h.cuda(),
                          index) is chunk_output_fwd


@pytest.mark.gpu
@pytest.mark.skipif(not gluon.available(), reason="needs an sm_90 GPU with Gluon")
def test_switch_runs_the_gluon_kernels_end_to_end(monkeypatch):
    """With ``GDN_CORE_GLUON=all`` a deterministic forward+backward (B1, 3 packed documents,
    bf16, K = V = 128) launches every stage's Gluon kernel, and every result stays within bf16
    tolerance of the Triton pipeline's."""
    import importlib

    from gdn_core.autograd import chunk_gdn_autograd
    from gdn_core.ops.registry import record_launches

    gen = torch.Generator().manual_seed(0)
    T, H = 777, 2
    cu = torch.tensor([0, 5, 300, T], dtype=torch.int32, device="cuda")
    base = [torch.randn(1, T, H, 128, generator=gen), torch.randn(1, T, H, 128, generator=gen),
            torch.randn(1, T, H, 128, generator=gen),
            torch.nn.functional.logsigmoid(torch.randn(1, T, H, generator=gen)),
            torch.rand(1, T, H, generator=gen)]
    base = [x.cuda().to(torch.bfloat16 if i in (0, 1, 2, 4) else torch.float32)
            for i, x in enumerate(base)]
    do = torch.randn(1, T, H, 128, generator=gen).cuda().bfloat16()

    def run():
        leaves = [x.clone().requires_grad_(True) for x in base]
        with record_launches() as launches, torch.autograd.set_multithreading_enabled(False):
            o, _ = chunk_gdn_autograd(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                      deterministic=True)
            o.backward(do)
        names = {launch.name.rsplit(".", 1)[-1] for launch in launches}
        return names, [o.detach()] + [x.grad for x in leaves]

    monkeypatch.setenv(gluon.GLUON_ENV, "none")  # Triton everywhere
    monkeypatch.setenv("GDN_CORE_FUSED_FWD", "0")  # the fused forward replaces state+output
    names, want = run()
    kernels = {stage: getattr(importlib.import_module(f"gdn_core.ops.gluon.{m}"), n).__name__
               for stage, (m, n, _) in gluon.STAGES.items()}
    assert not set(kernels.values()) & names
    monkeypatch.setenv(gluon.GLUON_ENV, "all")
    names, got = run()
    # grads2's persistent kernel supersedes grads' (and the forward saved the inverse: the
    # backward applies it, wy_fwd_gluon runs in the forward); "all" leaves out the stages
    # run by name only
    every = {n for stage, n in kernels.items() if stage not in gluon.BY_NAME_ONLY}
    assert every - {"chunk_grads_bwd_gluon"} <= names, every - names
    assert not {kernels[stage] for stage in gluon.BY_NAME_ONLY} & names
    assert "chunk_grads_bwd_gluon" not in names
    for a, b in zip(got, want):
        rel = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
        assert rel.item() < 2e-2, rel.item()


@pytest.mark.gpu
@pytest.mark.skipif(not gluon.available(), reason="needs an sm_90 GPU with Gluon")
def test_the_default_runs_the_gluon_chunk_gradients(monkeypatch):
    """Unset, the variable means :data:`~gdn_core.ops.gluon.DEFAULT_STAGES`: a det
    forward+backward (bf16, K = V = 128, 2 documents, L2 norm) launches the one-tile Gluon
    chunk-gradient kernel, the Gluon WY forward, the fused forward and the one-launch
    recompute, with the bits of ``GDN_CORE_GLUON=grads,wy,fused_fwd,recompute``, within bf16
    tolerance of ``none`` (the Triton kernels), and nothing else from Gluon (the default
    ``fused_state`` needs 96 programs: here 2 documents × 2 heads keep the pair)."""
    from gdn_core.autograd import chunk_gdn_autograd
    from gdn_core.ops.registry import record_launches

    gen = torch.Generator().manual_seed(2)
    T, H = 640, 2
    cu = torch.tensor([0, 200, T], dtype=torch.int32, device="cuda")
    base = [torch.randn(1, T, H, 128, generator=gen) for _ in range(3)]
    base += [torch.nn.functional.logsigmoid(torch.randn(1, T, H, generator=gen)),
             torch.rand(1, T, H, generator=gen)]
    base = [x.cuda().to(torch.float32 if i == 3 else torch.bfloat16) for i, x in enumerate(base)]
    do = torch.randn(1, T, H, 128, generator=gen).cuda().bfloat16()

    def run(value):
        if value is None:
            monkeypatch.delenv(gluon.GLUON_ENV, raising=False)
        else:
            monkeypatch.setenv(gluon.GLUON_ENV, value)
        leaves = [x.clone().requires_grad_(True) for x in base]
        # record_launches sees this thread only: keep autograd's CUDA backward on it
        with record_launches() as launches, torch.autograd.set_multithreading_enabled(False):
            o, _ = chunk_gdn_autograd(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                      deterministic=True)
            o.backward(do)
        names = {launch.name.rsplit(".", 1)[-1] for launch in launches}
        return names, [o.detach()] + [x.grad for x in leaves]

    names, got = run(None)
    gluon_names = {n for n in names if n.endswith(("_gluon", "_gluon_pipelined"))}
    assert gluon_names == {"chunk_grads_bwd_gluon", "wy_fwd_gluon", "chunk_fwd_fused_gluon",
                           "chunk_recompute_gluon"}, names
    _, asked = run("grads,wy,fused_fwd,recompute")
    _, triton = run("none")
    for a, b, c in zip(got, asked, triton):
        assert torch.equal(a, b)
        rel = ((a.float() - c.float()).abs().max() / c.float().abs().max().clamp_min(1e-6))
        assert rel.item() < 2e-2, rel.item()


@pytest.mark.gpu
@pytest.mark.skipif(not gluon.available(), reason="needs an sm_90 GPU with Gluon")
def test_a_gluon_kernel_launches_first_in_a_fresh_thread(monkeypatch):
    """A thread that never touched the GPU (a worker running a backward) has no current
    CUDA context; the first Gluon launch there fills TMA descriptors before Triton's
    launcher would bind one. It must run, with the bits of the same launch made here."""
    import threading

    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.gluon.output import chunk_output_fwd_gluon

    gen = torch.Generator().manual_seed(1)
    T, H, D = 300, 2, 128
    index = ChunkIndex.build([0, 100, T], "cuda")
    q, k, v_new = (torch.randn(T, H, D, generator=gen).cuda().bfloat16() for _ in range(3))
    h = (torch.randn(index.num_chunks, H, D, D, generator=gen) / D).cuda().bfloat16()
    G = torch.randn(T, H, generator=gen).cumsum(0).neg().cuda() / 64

    def launch():
        return chunk_output_fwd_gluon(q, k, v_new, h, G, 0.1, index, 1)

    result: dict = {}

    def worker():
        try:
            result["o"] = launch()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert torch.equal(result["o"], launch())
