"""GDN_CORE_BWD_ALIAS on the GPU: the one-tile Gluon chunk-gradient kernel writing ``dv``
over the backward's own ``dV'`` and (one value head per q/k head) ``dq`` over its own
``v_new`` (:func:`gdn_core.ops.backward.plan_aliases`).

Runs only where Gluon imports and the GPU is sm_90 (the H200). With the switch on (``1``),
unset (the default: on) and off: the same bits of every output and gradient (bf16 and fp16;
one document, packed documents with short last chunks, grouped value heads where only ``dv``
is aliased, the in-kernel L2 norm where ``dq`` is an fp32 partial, initial and final
states), the aliases asked for where expected and none with the persistent kernel; two
backward calls on one saved set give gradients that share no storage with each other, the
inputs or the saved set; and the forward+backward peak at T=8192 H=4 drops by at least 1.5
units of one ``[T, HV, 128]`` 16-bit tensor (2 expected: ``dq`` and ``dv``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gdn_core.ops import backward, gluon
from gdn_core.switches import BWD_ALIAS_ENV
from gdn_core.testkit import offsets_of, record_calls

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D = 128


@pytest.fixture(autouse=True)
def _needs_gluon(monkeypatch):
    if not gluon.available():
        pytest.skip("Gluon on an sm_90 GPU is not available here")
    monkeypatch.setenv(gluon.GLUON_ENV, "grads")  # the one-tile kernel (the default's), the pair


def _spy(monkeypatch):
    """Record every :func:`plan_aliases` call's keywords and result."""
    return record_calls(monkeypatch, backward, "plan_aliases")


def _inputs(lengths, H, HV, dtype, seed=0, h0=True):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, HV, D, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen) + 2.0) * 0.5
    beta = torch.rand(1, T, HV, generator=gen)
    xs = [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]
    if h0:
        xs.append(torch.randn(len(lengths), HV, D, D, generator=gen) * 0.1)
    do = torch.randn(1, T, HV, D, generator=gen).to(dtype)
    dht = torch.randn(len(lengths), HV, D, D, generator=gen)
    return [x.cuda() for x in xs], do.cuda(), dht.cuda()


CASES = {  # lengths, H, HV, l2 -> (dv over dV', dq over v_new)
    "one-doc": (([2048], 2, 2, False), (True, True)),
    "packed-short-chunks": (([5, 64, 70, 200, 1, 700], 2, 2, False), (True, True)),
    "grouped": (([5, 64, 70, 200], 2, 4, False), (True, False)),
    "l2norm": (([5, 64, 70, 200], 2, 2, True), (True, False)),
    "grouped-l2norm": (([70, 1000], 1, 2, True), (True, False)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_alias_keeps_every_bit(monkeypatch, case, dtype):
    from gdn_core.autograd import chunk_gdn_autograd

    (lengths, H, HV, l2), want = CASES[case]
    xs, do, dht = _inputs(lengths, H, HV, dtype)
    cu = torch.tensor(offsets_of(lengths), dtype=torch.int32, device="cuda")

    def run():
        leaves = [x.clone().requires_grad_(True) for x in xs]
        o, ht = chunk_gdn_autograd(*leaves[:5], initial_state=leaves[5],
                                   output_final_state=True, cu_seqlens=cu,
                                   use_qk_l2norm_in_kernel=l2, deterministic=True)
        torch.autograd.backward((o, ht), (do, dht))
        return [o.detach(), ht.detach()] + [x.grad for x in leaves]

    calls = _spy(monkeypatch)
    monkeypatch.setenv(BWD_ALIAS_ENV, "0")
    off = run()
    assert calls and all(res == (False, False) for _, res in calls)
    calls.clear()
    monkeypatch.setenv(BWD_ALIAS_ENV, "1")
    on = run()
    assert calls and all(res == want for _, res in calls), [res for _, res in calls]
    names = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for name, a, b in zip(names, on, off, strict=True):
        assert torch.equal(a, b), f"{name}: max|diff| {(a.float() - b.float()).abs().max():.3e}"
    calls.clear()
    monkeypatch.delenv(BWD_ALIAS_ENV)  # unset: the default, on where valid
    default = run()
    assert calls and all(res == want for _, res in calls), [res for _, res in calls]
    assert all(torch.equal(a, b) for a, b in zip(default, on, strict=True))  # and repeatable


def test_persistent_kernel_is_not_aliased(monkeypatch):
    from gdn_core.testkit import det_split_api

    chunk_gdn_det_fwd, chunk_gdn_det_bwd, _ = det_split_api()

    monkeypatch.setenv(gluon.GLUON_ENV, "grads2")
    monkeypatch.setenv(BWD_ALIAS_ENV, "1")  # asked for: still refused for the persistent kernel
    calls = _spy(monkeypatch)
    xs, do, dht = _inputs([5, 64, 700], 2, 2, torch.bfloat16)
    _, _, saved = chunk_gdn_det_fwd(*xs[:5], initial_state=xs[5], output_final_state=True,
                                    cu_seqlens=offsets_of([5, 64, 700]))
    chunk_gdn_det_bwd(saved, do, dht)
    assert calls and all(kw["kernel"] != "gluon" and res == (False, False)
                         for kw, res in calls)


def _tensors(obj, depth=3):
    """The tensors among ``obj``'s dataclass fields / attributes (recursively)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or obj is None:
        return []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("gd"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for x in items for t in _tensors(x, depth - 1)]


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("HV", [2, 4])
def test_two_backward_calls_give_independent_gradients(HV, monkeypatch):
    from gdn_core.testkit import det_split_api

    chunk_gdn_det_fwd, chunk_gdn_det_bwd, _ = det_split_api()

    monkeypatch.setenv(BWD_ALIAS_ENV, "1")

    lengths = [5, 64, 70, 200]
    xs, do, dht = _inputs(lengths, 2, HV, torch.bfloat16)
    o, ht, saved = chunk_gdn_det_fwd(*xs[:5], initial_state=xs[5], output_final_state=True,
                                     cu_seqlens=offsets_of(lengths))
    g1 = chunk_gdn_det_bwd(saved, do, dht)
    g2 = chunk_gdn_det_bwd(saved, do, dht)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    a = [getattr(g1, n) for n in names]
    b = [getattr(g2, n) for n in names]
    kept = [*xs, do, dht, o, ht, *_tensors(saved.core), *_tensors(saved.gate)]
    held = {_storage(t) for t in kept if t.numel()}
    ptrs = [_storage(t) for t in a + b]
    assert len(set(ptrs)) == len(ptrs), "two gradients share storage"
    assert not held & set(ptrs), "a gradient shares storage with an input or the saved set"
    snap = [t.clone() for t in b + kept]
    for t in a:
        t.add_(1)
    assert all(torch.equal(x, y) for x, y in zip(b + kept, snap, strict=True))


def test_peak_memory_drops(monkeypatch):
    """Forward+backward peak (T=8192, H=HV=4, bf16, q/k normalised before the call) with the
    switch off and on: at least 1.5 units of ``[T, HV, 128]`` 16-bit less (2 expected)."""
    from gdn_core.autograd import chunk_gdn_autograd

    T, H = 8192, 4
    xs, do, _ = _inputs([T], H, H, torch.bfloat16, h0=False)
    leaves = [x.requires_grad_(True) for x in xs]
    unit = T * H * D * 2

    def peak():
        for x in leaves:
            x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o, _ = chunk_gdn_autograd(*leaves, deterministic=True)
        o.backward(do)
        del o
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    got = {}
    for raw in ("0", "1"):
        monkeypatch.setenv(BWD_ALIAS_ENV, raw)
        peak()  # compiles, fills the caches
        got[raw] = peak()
    print(f"fwd+bwd peak extra: off {got['0'] / unit:.2f}, on {got['1'] / unit:.2f} units "
          f"({got['0'] / 2**20:.1f} -> {got['1'] / 2**20:.1f} MiB)")
    assert got["0"] - got["1"] >= 1.5 * unit
