"""The custom-op machinery (handles, stash), fixed-size layouts, and the ops' pieces.

Runs under the Triton interpreter (see conftest.py): the padded-layout tests
drive the real kernels over fixed-size tables and check they give the same
bits as the exact tables.
"""

from __future__ import annotations

import gc

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.conv1d import causal_conv1d_bwd, causal_conv1d_fwd
from gdn_core.custom_ops import (
    autograd_enabled,
    define_op,
    lookup,
    object_handle,
    register_handle,
    stash_get,
    stash_put,
    stash_size,
)
from gdn_core.layout import PaddedChunkIndex, VarlenLayout, layout_tables
from gdn_core.train_ops import SAVED_OUTPUTS, define_train_ops


class _Obj:
    pass


def test_handles_are_cpu_scalars_and_weak():
    a, b = _Obj(), _Obj()
    ha = register_handle(a)
    assert ha.device.type == "cpu" and ha.dim() == 0 and ha.dtype == torch.int64
    assert register_handle(a) is ha and object_handle(a) is ha
    assert int(object_handle(b)) != int(ha)
    assert lookup(ha) is a
    del a
    gc.collect()
    with pytest.raises(ValueError, match="no live object"):
        lookup(ha)


def test_stash_rebinds_inputs_clones_overlaps_and_frees_with_the_token():
    from dataclasses import dataclass

    @dataclass
    class Saved:
        whole: torch.Tensor
        flat: torch.Tensor
        part: torch.Tensor
        own: torch.Tensor
        items: tuple

    x = torch.randn(2, 3, 4)
    y = torch.randn(5)
    own = torch.randn(3)
    before = stash_size()
    token = stash_put(Saved(x, x.reshape(6, 4), x[0], own, (y, 1)), args=(x, None, y))
    assert stash_size() == before + 1
    x2, y2 = x.clone(), y.clone()  # "the backward's arguments": other tensors, same values
    got = stash_get(token, (x2, None, y2))
    assert got.whole is x2 and got.flat.data_ptr() == x2.data_ptr() and got.flat.shape == (6, 4)
    assert got.items[0] is y2 and got.items[1] == 1
    assert got.own is own
    assert got.part.data_ptr() != x.data_ptr() and torch.equal(got.part, x[0])  # cloned
    del token
    gc.collect()
    assert stash_size() == before


def test_stash_recognises_reshaped_views_of_strided_inputs():
    y = torch.randn(1, 10, 12)
    q, k = y[..., :4].reshape(1, 10, 1, 4), y[..., 4:8].reshape(1, 10, 1, 4)  # strided views
    token = stash_put((q.reshape(10, 1, 4), k.reshape(10, 1, 4)), args=(q, k))
    a, b = stash_get(token, (q, k))
    assert a.data_ptr() == q.data_ptr() and b.data_ptr() == k.data_ptr()  # not clones
    assert torch.equal(a, q.reshape(10, 1, 4)) and torch.equal(b, k.reshape(10, 1, 4))


def test_autograd_inside_an_op_implementation():
    def impl(x: torch.Tensor) -> torch.Tensor:
        with autograd_enabled():
            leaf = x.detach().requires_grad_()
            (grad,) = torch.autograd.grad((leaf.sin() * 3).sum(), leaf)
        return grad

    op = define_op("gdn_core_test_ag", "f", impl, fake=lambda x: torch.empty_like(x))
    x = torch.randn(5)
    torch.testing.assert_close(op(x), 3 * x.cos())
    with torch.no_grad():
        torch.testing.assert_close(op(x), 3 * x.cos())


# ------------------------------------------------------------------ layouts --


def test_layout_tables_and_in_place_update():
    lay = VarlenLayout([0, 5, 70, 100], max_docs=5)
    assert lay.max_chunks == 2 + 5 - 1 and lay.num_docs == 3 and lay.num_chunks == 4
    assert isinstance(lay.index, PaddedChunkIndex) and lay.index.num_chunks == 6
    assert lay.padded_offsets == (0, 5, 70, 100, 100, 100)
    assert lay.cu_seqlens.tolist() == [0, 5, 70, 100, 100, 100]
    assert lay.index.chunk_len.tolist() == [5, 64, 1, 30, 0, 0]
    assert lay.index.chunk_start.tolist()[-2:] == [100, 100]
    assert lay.index.doc_chunk_offsets.tolist() == [0, 1, 3, 4, 4, 4]
    assert lay.doc_pos.tolist()[:7] == [0, 1, 2, 3, 4, 0, 1]
    ptrs = [t.data_ptr() for t in (lay.cu_seqlens, lay.doc_pos, lay.index.chunk_start)]
    lay.update(torch.tensor([0, 100]))
    assert [t.data_ptr() for t in (lay.cu_seqlens, lay.doc_pos, lay.index.chunk_start)] == ptrs
    assert lay.offsets == (0, 100) and lay.cu_seqlens.tolist() == [0] + [100] * 5
    assert lay.index.chunk_len.tolist() == [64, 36, 0, 0, 0, 0]
    assert lay.doc_pos.tolist() == list(range(100))
    with pytest.raises(ValueError, match="max_docs"):
        lay.update([0] + list(range(10, 100, 10)) + [100])
    with pytest.raises(ValueError, match="T=100"):
        lay.update([0, 50])
    exact = VarlenLayout([0, 5, 70, 100])
    assert exact.max_docs == 3 and exact.max_chunks == 4
    exact.update([0, 1, 2, 100])  # 1 + 1 + 2 chunks: fits
    with pytest.raises(ValueError, match="max_chunks"):
        VarlenLayout([0, 100], max_chunks=1)
    tabs = layout_tables((0, 3), 2, 3)
    assert tabs["chunk_offsets"] == [0, 1, 1] and tabs["chunk_len"] == [3, 0, 0]


def test_conv_doc_pos_masks_match_cu_seqlens_bitwise():
    gen = torch.Generator().manual_seed(0)
    T, D, W = 90, 6, 4
    x = torch.randn(1, T, D, generator=gen)
    w = torch.randn(D, W, generator=gen)
    b = torch.randn(D, generator=gen)
    dy = torch.randn(1, T, D, generator=gen)
    halo = torch.randn(1, W - 1, D, generator=gen)
    for offs in ([0, 2, 40, 41, 90], [0, 90]):
        lay = VarlenLayout(offs, max_docs=6)
        for h in (None, halo):
            want = causal_conv1d_fwd(x, w, b, "silu", offs, h)
            got = causal_conv1d_fwd(x, w, b, "silu", None, h, doc_pos=lay.doc_pos)
            assert torch.equal(got, want)
            gw = causal_conv1d_bwd(x, w, b, dy, "silu", offs, h, deterministic=True)
            gg = causal_conv1d_bwd(x, w, b, dy, "silu", None, h, deterministic=True,
                                   doc_pos=lay.doc_pos)
            for a, c in zip(gg, gw):
                assert (a is None and c is None) or torch.equal(a, c)


def _gdn_inputs(T, H=1, HV=2, K=16, V=16, N=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -0.3 * torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = torch.randn(N, HV, K, V, generator=gen)
    do = torch.randn(1, T, HV, V, generator=gen)
    dht = torch.randn(N, HV, K, V, generator=gen)
    return q, k, v, g, beta, h0, do, dht


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_padded_layout_gives_the_exact_layouts_bits(backend):
    # the kernels over fixed-size tables (empty documents, empty chunks) = exact tables
    T = 150
    lay = VarlenLayout([0, 10, 140, 150], max_docs=5)  # 4 real chunks of 7
    for offs in ([0, 10, 140, 150], [0, 64, 65, 150]):
        lay.update(offs)
        q, k, v, g, beta, h0, do, dht = _gdn_inputs(T, N=3)
        pad_h0 = torch.cat([h0, torch.randn(2, *h0.shape[1:])])
        pad_dht = torch.cat([dht, torch.randn(2, *dht.shape[1:])])
        o1, f1, s1 = chunk_gdn_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=offs, use_qk_l2norm_in_kernel=True,
                                   deterministic=True, backend=backend)
        g1 = chunk_gdn_bwd(s1, do, dht, deterministic=True)
        o2, f2, s2 = chunk_gdn_fwd(q, k, v, g, beta, initial_state=pad_h0,
                                   output_final_state=True, cu_seqlens=list(lay.padded_offsets),
                                   use_qk_l2norm_in_kernel=True, deterministic=True,
                                   backend=backend, index=lay.index)
        if backend == "triton":
            assert s2.index is lay.index
        g2 = chunk_gdn_bwd(s2, do, pad_dht, deterministic=True)
        assert torch.equal(o1, o2) and torch.equal(f1, f2[:3])
        assert torch.equal(f2[3:], pad_h0[3:])  # empty documents pass their state through
        for n in ("dq", "dk", "dv", "dg", "dbeta"):
            assert torch.equal(getattr(g1, n), getattr(g2, n)), n
        assert torch.equal(g1.dh0, g2.dh0[:3]) and torch.equal(g2.dh0[3:], pad_dht[3:])


def test_plain_chunk_index_is_still_a_chunk_index():
    lay = VarlenLayout([0, 3])
    assert isinstance(lay.index, ChunkIndex) and lay.index.num_chunks == 1


# ------------------------------------------------------------ train ops --


def test_train_ops_opcheck_and_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = define_train_ops("gdn_core_test_train", deterministic=True)
    assert define_train_ops("gdn_core_test_train", deterministic=True) is ops
    with pytest.raises(ValueError, match="deterministic"):
        define_train_ops("gdn_core_test_train", deterministic=False)
    q, k, v, g, beta, h0, do, dht = _gdn_inputs(70, N=2)
    cu = torch.tensor([0, 30, 70])
    args = (q, k, v, g, beta, h0, None, None, cu, None, None, None, True, True, False,
            "reference", None)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(ops.gdn, args, test_utils=utils)
    o, final, *saved = ops.gdn(*args)
    assert final.shape == (2, 2, 16, 16) and len(saved) == len(SAVED_OUTPUTS)
    # the backward op gets the forward's inputs and saved outputs back, then its scalars
    torch.library.opcheck(ops.gdn_bwd, (do, dht, *args[:11], *saved, *args[11:]),
                          test_utils=("test_schema", "test_faketensor"))
    x, w = torch.randn(1, 70, 8), torch.randn(8, 4)
    torch.library.opcheck(ops.conv, (x, w, None, None, cu, None, "silu"), test_utils=utils)
    with FakeTensorMode() as mode:
        fq, fk, fv, fg, fb = (mode.from_tensor(t) for t in (q, k, v, g, beta))
        fcu = mode.from_tensor(torch.tensor([0, 1, 2, 70]))
        o, final, *saved = ops.gdn(fq, fk, fv, fg, fb, None, None, None, fcu, None, None,
                                   None, True, False, False, None, None)
        assert o.shape == v.shape and o.dtype == v.dtype
        assert final.shape == (3, 2, 16, 16) and final.dtype == torch.float32
        assert len(saved) == len(SAVED_OUTPUTS)


def test_front_end_autograd_call_of_a_fixed_length_batch():
    # B > 1 without cu_seqlens on the kernels: the op must get no offsets (B == 1 only)
    from gdn_core import testkit
    from gdn_core.autograd import TrainGrads, TrainSaved, TrainWorkspace
    from gdn_core.frontend import SingleRankAPI

    class Saved(TrainSaved):
        deterministic = True

    class Workspace(TrainWorkspace):
        deterministic = True

    class Grads(TrainGrads):
        deterministic = True

    api = SingleRankAPI("gdn_core_test_train", deterministic=True, saved_cls=Saved,
                        workspace_cls=Workspace, grads_cls=Grads)
    call = api.autograd_call("call", summary="", mode="", segments="")
    inputs, cu, cot = testkit.make_inputs(B=2, T=70, H=1, HV=2, seed=9)
    got = testkit.run_fwd_bwd(call, inputs, cu, cot, l2norm=True)
    ref = testkit.run_fwd_bwd(testkit.reference_gdn, inputs, cu, cot, l2norm=True)
    testkit.assert_close(got, ref, rtol=2e-5)
