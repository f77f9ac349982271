"""The fused reverse state recurrence (``gdn_core.ops.chunk_state_bwd_fused``), under the
interpreter: the bits of ``chunk_state_bwd(dv_local_bwd(...))`` (packed uneven documents,
one shorter than a chunk and an empty one; group 1 and 2; with and without ``dht``;
fp32 and fp16; K wider than ``dv_local``'s K block, where the summation order matters),
close to a float64 reference, bitwise repeatable; ``store=False`` / ``need`` and ``dh0``
over ``dht``; the pinned configuration; the routing switch of ``backward_from_recompute``.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import backward
from gdn_core.ops import chunk_state_bwd_fused as fused_module
from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
from gdn_core.ops.chunk_state_bwd_fused import chunk_state_bwd_fused, chunk_state_bwd_fused_config
from gdn_core.ops.cumsum import chunk_cumsum_fwd
from gdn_core.ops.dv_local import dv_local_bwd
from gdn_core.ops.registry import record_launches
from gdn_core.testkit import max_rel_err, offsets_of

# CPU tensors: the kernels must be interpreted (on a GPU machine, the *_gpu.py file runs)
pytestmark = pytest.mark.skipif(
    type(fused_module._chunk_state_bwd_fused_kernel).__name__ != "InterpretedFunction",
    reason="needs the Triton interpreter (TRITON_INTERPRET=1); the GPU file covers CUDA")

LENGTHS = [5, 70, 0, 30]  # one shorter than a chunk, a short last chunk, an empty document
NAMES = ("dh", "dv", "dh0")


def _problem(lengths, H, group, dtype, K=16, V=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, HV = offs[-1], H * group
    index = ChunkIndex.build(offs, "cpu")
    q = (torch.randn(T, H, K, generator=gen) * 0.3).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen), dim=-1).to(dtype)
    W = (torch.randn(T, HV, K, generator=gen) * 0.1).to(dtype)
    do = torch.randn(T, HV, V, generator=gen).to(dtype)
    G = chunk_cumsum_fwd(-torch.rand(T, HV, generator=gen) * 0.3 - 0.01, index)
    dht = torch.randn(len(lengths), HV, K, V, generator=gen)
    return offs, index, (q, k, W, G, do), dht


def _two_kernels(xs, dht, scale, index, group, **kw):
    q, k, W, G, do = xs
    dvl = dv_local_bwd(q, k, G, do, scale, index, group)
    return chunk_state_bwd(q, k, W, G, do, dvl, dht, scale, index, group, **kw)


def _fused(xs, dht, scale, index, group, **kw):
    q, k, W, G, do = xs
    return chunk_state_bwd_fused(q, k, W, G, do, dht, scale, index, group, **kw)


def _reference(offs, xs, dht, scale, group, chunk=64):
    """The stage (a)+(b) formulas in float64, chunk by chunk: ``(dh, dv, dh0)``."""
    q, k, W, G, do = (x.double() for x in xs)
    T, H, K = k.shape
    HV, V = do.shape[1:]
    dh, dv, dh0 = [], torch.zeros(T, HV, V, dtype=torch.float64), []
    for n, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        S = (dht[n].double().clone() if dht is not None
             else torch.zeros(HV, K, V, dtype=torch.float64))
        per_doc = []
        for t0 in reversed(range(bos, eos, chunk)):
            t1 = min(t0 + chunk, eos)
            per_doc.append(S.clone())
            for hv in range(HV):
                h = hv // group
                Qc, Kc, Wc, dOc, g = (q[t0:t1, h], k[t0:t1, h], W[t0:t1, hv], do[t0:t1, hv],
                                      G[t0:t1, hv])
                mask = torch.ones(t1 - t0, t1 - t0, dtype=torch.bool).tril()
                P = (Qc @ Kc.T) * torch.where(mask, (g[:, None] - g[None, :]).exp(), 0.0)
                dvp = scale * P.T @ dOc + (g[-1] - g).exp()[:, None] * (Kc @ S[hv])
                dv[t0:t1, hv] = dvp
                S[hv] = (g[-1].exp() * S[hv] + scale * Qc.T @ (g.exp()[:, None] * dOc)
                         - Wc.T @ dvp)
        dh += reversed(per_doc)
        dh0.append(S)
    return torch.stack(dh), dv, torch.stack(dh0)


@pytest.mark.parametrize("with_dht", [True, False])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_gives_the_two_kernels_bits(dtype, group, with_dht):
    offs, index, xs, dht = _problem(LENGTHS, 1, group, dtype)
    dht = dht if with_dht else None
    scale = 16**-0.5
    got = _fused(xs, dht, scale, index, group)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == torch.float32
    for name, a, b in zip(NAMES, got, _two_kernels(xs, dht, scale, index, group)):
        assert torch.equal(a, b), name
    for name, a, b in zip(NAMES, got, _fused(xs, dht, scale, index, group)):
        assert torch.equal(a, b), f"{name}: not repeatable"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, r in zip(NAMES, got, _reference(offs, xs, dht, scale, group)):
        assert max_rel_err(a, r) <= tol, name
    if not with_dht:
        assert torch.equal(got[2][2], torch.zeros_like(got[2][2]))  # the empty document


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_bits_when_k_spans_several_dv_local_blocks(dtype):
    """K = 96: ``Pᵀ`` is summed over two 64-wide K blocks as ``_dv_local_kernel`` sums it
    (one 128-wide dot differs in the last fp32 bit)."""
    cfg = chunk_state_bwd_fused_config(96, 32, torch.tensor([], dtype=dtype).element_size())
    assert cfg["BKL"] < cfg["BK"]
    offs, index, xs, dht = _problem([40, 60], 1, 2, dtype, K=96, V=32, seed=3)
    scale = 96**-0.5
    got = _fused(xs, dht, scale, index, 2)
    for name, a, b in zip(NAMES, got, _two_kernels(xs, dht, scale, index, 2)):
        assert torch.equal(a, b), name
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, r in zip(NAMES, got, _reference(offs, xs, dht, scale, 2)):
        assert max_rel_err(a, r) <= tol, name


def test_fused_first_pass_and_aliasing():
    """``store=False`` with ``need`` (a first pass): the stored call's ``dh0`` for wanted
    documents, other rows untouched; ``dh0`` written over ``dht``: the same bits."""
    _, index, xs, dht = _problem(LENGTHS, 1, 2, torch.float16, seed=1)
    scale = 0.25
    dh, dv, dh0 = _fused(xs, dht, scale, index, 2)
    need = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    buf = torch.full_like(dh0, 7.0)
    r = _fused(xs, dht, scale, index, 2, store=False, need=need, dh0=buf)
    assert r[0] is None and r[1] is None and r[2] is buf
    for n in range(len(LENGTHS)):
        assert torch.equal(buf[n], dh0[n] if need[n] else torch.full_like(dh0[n], 7.0)), n
    over = dht.clone()
    dh_a, dv_a, dh0_a = _fused(xs, over, scale, index, 2, dh0=over)
    assert dh0_a is over
    assert torch.equal(dh_a, dh) and torch.equal(dv_a, dv) and torch.equal(over, dh0)
    with pytest.raises(ValueError, match="need must be int32"):
        _fused(xs, dht, scale, index, 2, need=need.long())
    with pytest.raises(ValueError, match="dh0 must be"):
        _fused(xs, dht, scale, index, 2, dh0=dh0.half())


def test_fused_config_is_pinned():
    # bf16 K = V = 128: the recurrence's tiles, dv_local's 64-wide K blocks, two stages
    assert chunk_state_bwd_fused_config(128, 128) == {
        "BK": 128, "BV": 32, "BKL": 64, "num_warps": 4, "num_stages": 2}
    # K = 64: one K block, the recurrence's three stages
    assert chunk_state_bwd_fused_config(64, 64)["num_stages"] == 3
    assert chunk_state_bwd_fused_config(64, 64)["BKL"] == 64
    assert chunk_state_bwd_fused_config(128, 128, 4)["num_stages"] == 1


def test_use_fused_state_bwd(monkeypatch):
    env = backward.FUSED_BWD_ENV
    monkeypatch.delenv(env, raising=False)
    assert not backward.use_fused_state_bwd(True, False, 128)
    for off in ("0", ""):
        monkeypatch.setenv(env, off)
        assert not backward.use_fused_state_bwd(True, False, 128)
    monkeypatch.setenv(env, "1")
    assert backward.use_fused_state_bwd(True, False, 128)
    assert backward.use_fused_state_bwd(True, False, 16)
    assert not backward.use_fused_state_bwd(False, False, 128)  # not CUDA
    assert not backward.use_fused_state_bwd(True, True, 128)  # the caller's dv_local
    assert not backward.use_fused_state_bwd(True, False, 256)  # spills at K = 256
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError, match=env):
        backward.use_fused_state_bwd(True, False, 128)


@pytest.mark.parametrize("group", [1, 2])
def test_backward_routes_to_the_fused_kernel(group, monkeypatch):
    """With the switch's decision forced on (the interpreter is not CUDA) the whole
    backward launches the fused kernel instead of the two and gives the same bits."""
    from gdn_core.ops.forward import gdn_forward_triton

    offs, index, (q, k, _, _, do), dht = _problem(LENGTHS, 1, group, torch.float16, seed=2)
    gen = torch.Generator().manual_seed(5)
    T, HV = offs[-1], group
    v = torch.randn(T, HV, 16, generator=gen).half()
    g = -torch.rand(T, HV, generator=gen) * 0.3
    beta = torch.rand(T, HV, generator=gen).half()
    fwd = gdn_forward_triton(q, k, v, g, beta, scale=0.25, index=index, initial_state=None,
                             output_final_state=False, use_qk_l2norm_in_kernel=False)

    def run():
        with record_launches() as launches:
            out = backward.chunk_gdn_backward(
                fwd.q_used, fwd.k_used, v, g, beta, fwd.G, scale=0.25, index=index,
                initial_state=None, do=do, dht=dht, deterministic=True)
        return out, {x.name.rsplit(".", 1)[-1] for x in launches}

    base, names = run()
    assert {"dv_local_bwd", "chunk_state_bwd"} <= names and "chunk_state_bwd_fused" not in names
    monkeypatch.setattr(backward, "use_fused_state_bwd", lambda is_cuda, has_dv_local, K: True)
    fused, names = run()
    assert "chunk_state_bwd_fused" in names
    assert not names & {"dv_local_bwd", "chunk_state_bwd"}
    for i, (a, b) in enumerate(zip(fused, base)):
        assert torch.equal(a, b), i


def test_det_api_in_slabs_routes_to_the_fused_kernel(monkeypatch):
    """The public det API, unsegmented, the last phase in slabs (the backward gets no
    ``dv_local``): with the decision forced on, the fused kernel runs and every gradient
    keeps its bits."""
    det = pytest.importorskip("gdn_det_train")
    from gdn_core import bwd_slabs

    lengths, D, HV = [50, 5, 80], 16, 2
    gen = torch.Generator().manual_seed(3)
    T = sum(lengths)
    shapes = [(1, T, 1, D), (1, T, 1, D), (1, T, HV, D), (1, T, HV), (1, T, HV)]
    base = [torch.randn(*s, generator=gen) for s in shapes]
    base[3] = torch.nn.functional.logsigmoid(base[3]) * 0.1
    base[4] = base[4].sigmoid()
    h0 = torch.randn(len(lengths), HV, D, D, generator=gen)
    do = torch.randn(1, T, HV, D, generator=gen).half()
    dht = torch.randn(len(lengths), HV, D, D, generator=gen)
    monkeypatch.setenv(bwd_slabs.SLAB_ENV, "40")  # two slabs: documents 0 | 1, 2

    def run():
        leaves = [x.to(torch.float32 if i == 3 else torch.float16).requires_grad_()
                  for i, x in enumerate(base)]
        init = h0.clone().requires_grad_()
        with record_launches() as launches:
            o, ht = det.chunk_gated_delta_rule_det(
                *leaves, initial_state=init, output_final_state=True,
                cu_seqlens=offsets_of(lengths), use_qk_l2norm_in_kernel=True, segment_size=0)
            ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
        grads = [x.grad for x in leaves] + [init.grad]
        return grads, {x.name.rsplit(".", 1)[-1] for x in launches}

    want, names = run()
    assert "dv_local_bwd" in names and "chunk_state_bwd_fused" not in names
    monkeypatch.setattr(backward, "use_fused_state_bwd", lambda is_cuda, has_dv_local, K: True)
    got, names = run()
    assert "chunk_state_bwd_fused" in names and "dv_local_bwd" not in names
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i


def test_det_api_in_segments_routes_every_reverse_pass_to_the_fused_kernel(monkeypatch):
    """The public det API with documents longer than a segment (the segment backward's
    first pass and its last phase): with the decision forced on, only the fused kernel
    runs the reverse passes and every gradient keeps its bits."""
    det = pytest.importorskip("gdn_det_train")

    lengths, D, HV = [150, 5, 80], 16, 2
    gen = torch.Generator().manual_seed(4)
    T = sum(lengths)
    shapes = [(1, T, 1, D), (1, T, 1, D), (1, T, HV, D), (1, T, HV), (1, T, HV)]
    base = [torch.randn(*s, generator=gen) for s in shapes]
    base[3] = torch.nn.functional.logsigmoid(base[3]) * 0.1
    base[4] = base[4].sigmoid()
    do = torch.randn(1, T, HV, D, generator=gen).half()

    def run():
        leaves = [x.to(torch.float32 if i == 3 else torch.float16).requires_grad_()
                  for i, x in enumerate(base)]
        with record_launches() as launches:
            o, _ = det.chunk_gated_delta_rule_det(
                *leaves, cu_seqlens=offsets_of(lengths), use_qk_l2norm_in_kernel=True,
                segment_size=64)
            (o.float() * do.float()).sum().backward()
        return [x.grad for x in leaves], [x.name.rsplit(".", 1)[-1] for x in launches]

    want, names = run()
    assert names.count("chunk_state_bwd") == 2 and "chunk_state_bwd_fused" not in names
    monkeypatch.setattr(backward, "use_fused_state_bwd", lambda is_cuda, has_dv_local, K: True)
    got, names = run()
    assert names.count("chunk_state_bwd_fused") == 2
    assert not {"dv_local_bwd", "chunk_state_bwd"} & set(names)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
