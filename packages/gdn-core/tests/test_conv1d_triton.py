"""The conv1d Triton kernels (:mod:`gdn_core.ops.conv1d`, :mod:`gdn_core.ops.conv1d_bwd`)
against the torch path of :mod:`gdn_core.conv1d` — on the GPU, or under the interpreter
without one (``GDN_CORE_BACKEND=triton`` routes CPU tensors to them; small shapes).

Covered: packed documents (empty and one-token ones), rows without documents, the
halo and its gradient, ``doc_pos``, bias, both activations, widths 1–4, strided
inputs, two token blocks of the weight-gradient partials; fp32 tight and fp16 loose
against fp64 torch; bitwise repeats; NaN/Inf containment per document; the KCP
sharding identity; bad inputs raise as before.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.containment import assert_other_documents_equal, check_conv_containment, plant
from gdn_core.conv1d import causal_conv1d, causal_conv1d_bwd, causal_conv1d_fwd
from gdn_core.ops.conv1d_bwd import CONV_BWD_TOKEN_BLOCK
from gdn_core.ops.registry import record_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("GDN_CORE_BACKEND", "triton")
    yield


def _rand(*shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _inputs(B, T, D, W, bias, halo, dtype=torch.float32, seed=0):
    x, dy = _rand(B, T, D, seed=seed, dtype=dtype), _rand(B, T, D, seed=seed + 1, dtype=dtype)
    w = _rand(D, W, seed=seed + 2) * 0.5
    b = _rand(D, seed=seed + 3) if bias else None
    h = _rand(B, W - 1, D, seed=seed + 4, dtype=dtype) if halo else None
    return x, w, b, dy, h


def _both(x, w, b, dy, act, cu, h, doc_pos=None):
    """``[y, dx, dweight, dbias, dhalo]`` of the kernels (launches checked)."""
    with record_launches() as launches:
        y = causal_conv1d_fwd(x, w, b, act, cu, h, doc_pos=doc_pos)
        grads = causal_conv1d_bwd(x, w, b, dy, act, cu, h, deterministic=True, doc_pos=doc_pos)
    names = [launch.name.rsplit(".", 1)[-1] for launch in launches]
    assert names == ["conv1d_fwd", "conv1d_bwd"], names
    assert not any(launch.uses_atomics for launch in launches)
    return [y, *grads]


def _torch64(x, w, b, dy, act, cu, h):
    """The torch path in fp64 (its own reference, checked against F.conv1d elsewhere)."""
    def d(t):
        return t.detach().double() if t is not None else None

    y = causal_conv1d_fwd(d(x), d(w), d(b), act, cu, d(h))
    return [y, *causal_conv1d_bwd(d(x), d(w), d(b), d(dy), act, cu, d(h), deterministic=True)]


def _assert_close(got, want, tol):
    for i, (a, r) in enumerate(zip(got, want)):
        if r is None:
            assert a is None, i
            continue
        assert a.shape == r.shape, i
        scale = max(1.0, r.abs().max().item()) if r.numel() else 1.0
        torch.testing.assert_close(a.double(), r, rtol=tol, atol=tol * scale, msg=f"output {i}")


CASES = {
    # B, T, D, W, bias, activation, cu_seqlens, halo
    "packed+halo": (1, 40, 5, 4, True, "silu", [0, 2, 2, 30, 31, 40], True),
    "rows+halo, 2 channel blocks": (2, 18, 70, 3, False, None, None, True),
    "leading empty doc": (1, 24, 3, 4, False, "silu", [0, 0, 9, 24], False),
    "width 1": (1, 12, 4, 1, True, "silu", [0, 5, 12], True),
    "width 2, one doc": (1, 20, 4, 2, True, None, [0, 20], False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_matches_torch(case):
    B, T, D, W, bias, act, cu, halo = CASES[case]
    x, w, b, dy, h = _inputs(B, T, D, W, bias, halo, seed=len(case))
    got = _both(x, w, b, dy, act, cu, h)
    _assert_close(got, _torch64(x, w, b, dy, act, cu, h), 1e-5)
    again = _both(x, w, b, dy, act, cu, h)
    for a, c in zip(got, again):
        assert (a is None and c is None) or torch.equal(a, c)


def test_two_token_blocks_of_partials():
    """Several blocks of the dweight/dbias partials (the fixed-order sum), short last one."""
    T = CONV_BWD_TOKEN_BLOCK + 16
    cu = [0, 7, CONV_BWD_TOKEN_BLOCK - 1, T]
    x, w, b, dy, h = _inputs(1, T, 3, 4, True, True, seed=11)
    got = _both(x, w, b, dy, "silu", cu, h)
    _assert_close(got, _torch64(x, w, b, dy, "silu", cu, h), 1e-5)
    again = _both(x, w, b, dy, "silu", cu, h)
    assert all(torch.equal(a, c) for a, c in zip(got, again))


def test_doc_pos_equals_cu_seqlens():
    cu = [0, 3, 4, 17, 20]
    x, w, b, dy, _ = _inputs(1, 20, 4, 4, True, False, seed=21)
    doc_pos = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1], cu[1:])]).to(
        DEVICE, torch.int32)
    a = _both(x, w, b, dy, "silu", cu, None)
    c = _both(x, w, b, dy, "silu", None, None, doc_pos=doc_pos)
    assert all((u is None and v is None) or torch.equal(u, v) for u, v in zip(a, c))


def test_fp16_loose():
    cu = [0, 9, 30]
    x, w, b, dy, h = _inputs(1, 30, 6, 4, True, True, dtype=torch.float16, seed=31)
    got = _both(x, w, b, dy, "silu", cu, h)
    assert got[0].dtype == got[1].dtype == got[4].dtype == torch.float16
    assert got[2].dtype == got[3].dtype == torch.float32
    _assert_close(got, _torch64(x, w, b, dy, "silu", cu, h), 2e-2)


def test_strided_views_without_copy():
    """``x``/``dy`` as column slices of wider tensors, a transposed weight, channels-first
    storage: the same bits as the contiguous tensors."""
    cu = [0, 6, 20]
    x, w, b, dy, h = _inputs(1, 20, 5, 4, True, True, seed=41)
    wide = _rand(1, 20, 12, seed=42)
    wide[..., 3:8] = x
    wide_dy = _rand(1, 20, 9, seed=43)
    wide_dy[..., 1:6] = dy
    wt = w.T.contiguous().T  # [D, W] with strides (1, D)
    got = _both(wide[..., 3:8], wt, b, wide_dy[..., 1:6], "silu", cu, h)
    want = _both(x, w, b, dy, "silu", cu, h)
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    # channels-first storage (a transposed view) is copied once, same bits
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    got = _both(xt, w, b, dy.transpose(1, 2).contiguous().transpose(1, 2), "silu", cu, h)
    assert all(torch.equal(a, c) for a, c in zip(got, want))


def test_autograd_and_routing():
    """:func:`causal_conv1d` (autograd) runs the kernels; fp64 and
    ``GDN_CORE_BACKEND=reference`` run the torch path."""
    x, w, b, dy, _ = _inputs(1, 16, 3, 4, True, False, seed=51)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    # record_launches sees this thread only: on CUDA autograd would run the backward
    # on its device thread, so keep it here.
    with record_launches() as launches, torch.autograd.set_multithreading_enabled(False):
        causal_conv1d(*leaves, "silu", [0, 4, 16], deterministic=True).backward(dy)
    assert [launch.name.rsplit(".", 1)[-1] for launch in launches] == ["conv1d_fwd",
                                                                       "conv1d_bwd"]
    want = _both(x, w, b, dy, "silu", [0, 4, 16], None)
    assert torch.equal(leaves[0].grad, want[1]) and torch.equal(leaves[1].grad, want[2])
    with record_launches() as launches:
        causal_conv1d_fwd(x.double(), w.double(), b.double(), "silu", [0, 4, 16])
    assert not launches


def test_reference_backend_runs_torch(monkeypatch):
    monkeypatch.setenv("GDN_CORE_BACKEND", "reference")
    x, w, b, dy, _ = _inputs(1, 8, 3, 4, True, False, seed=52)
    with record_launches() as launches:
        causal_conv1d_bwd(x, w, b, dy, "silu", [0, 4, 8], deterministic=True)
    assert not launches


def test_sharded_with_halo_equals_whole():
    """The KCP use: rank 1 gets tokens ``[cut, T)`` and the halo of its first document;
    its dhalo sent back to rank 0's dx gives the whole dx; dweight sums."""
    T, D, W, cut = 40, 3, 4, 22
    cu = [0, 5, 20, 40]
    x, w, b, dy, _ = _inputs(1, T, D, W, True, False, seed=61)
    whole = _both(x, w, b, dy, "silu", cu, None)
    halo = x.new_zeros(1, W - 1, D)
    lo = max(cut - (W - 1), 20)
    halo[:, W - 1 - (cut - lo):] = x[:, lo:cut]
    y0, dx0, dw0, db0, _ = _both(x[:, :cut], w, b, dy[:, :cut], "silu", [0, 5, 20, cut], None)
    y1, dx1, dw1, db1, dh1 = _both(x[:, cut:], w, b, dy[:, cut:], "silu", [0, T - cut], halo)
    torch.testing.assert_close(torch.cat([y0, y1], 1), whole[0])
    dx = torch.cat([dx0, dx1], 1)
    dx[:, lo:cut] += dh1[:, W - 1 - (cut - lo):]
    torch.testing.assert_close(dx, whole[1])
    torch.testing.assert_close(dw0 + dw1, whole[2])
    torch.testing.assert_close(db0 + db1, whole[3])


OFFS = [0, 5, 6, 13, 20]  # a one-token document among others


@pytest.mark.parametrize("where, value, doc", [
    ("x", NAN, 0), ("x", INF, 1), ("x", -INF, 3), ("dy", NAN, 1), ("dy", INF, 2),
])
def test_nonfinite_stays_in_its_document(where, value, doc):
    check_conv_containment(lambda x, w, b: causal_conv1d(x.to(DEVICE), w.to(DEVICE),
                                                         b.to(DEVICE), "silu", OFFS,
                                                         deterministic=True).cpu(),
                           OFFS, where, value, doc)


def test_nonfinite_halo_and_doc_pos():
    """A NaN halo reaches only the first document; a NaN document through ``doc_pos``
    stays in it (``y``, ``dx``, ``dhalo``)."""
    x, w, b, dy, h = _inputs(1, 20, 3, 4, True, True, seed=71)
    clean = _both(x, w, b, dy, "silu", OFFS, h)
    bad = _both(x, w, b, dy, "silu", OFFS, torch.full_like(h, NAN))
    for i in (0, 1):
        assert_other_documents_equal(bad[i], clean[i], OFFS, 0, f"output {i}")
    doc_pos = torch.cat([torch.arange(e - s) for s, e in zip(OFFS[:-1], OFFS[1:])]).to(DEVICE)
    xb = plant(x, OFFS, 2, NAN)
    got = _both(xb, w, b, dy, "silu", None, h, doc_pos=doc_pos)
    ref = _both(x, w, b, dy, "silu", None, h, doc_pos=doc_pos)
    for i in (0, 1):
        assert_other_documents_equal(got[i], ref[i], OFFS, 2, f"output {i} (doc_pos)")
    assert torch.equal(got[4], ref[4]), "dhalo"


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(halo=torch.zeros(1, 2, 8)), ValueError, r"halo must have shape \(B=1, W-1=3, D=8\)"),
    (dict(cu_seqlens=[0, 6, 4, 10]), ValueError, "non-decreasing"),
    (dict(cu_seqlens=[0, 3.5, 10]), TypeError, "cu_seqlens entries must be ints"),
    (dict(doc_pos=torch.zeros(9, dtype=torch.int32)), ValueError, "doc_pos must be"),
    (dict(doc_pos=torch.zeros(10, dtype=torch.int32), cu_seqlens=[0, 10]), ValueError,
     "not both"),
])
def test_bad_inputs_unchanged(kwargs, exc, pattern):
    args = dict(x=torch.zeros(1, 10, 8), weight=torch.zeros(8, 4), bias=None,
                activation="silu", cu_seqlens=None, halo=None)
    args.update(kwargs)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(exc, match=pattern):
        causal_conv1d_fwd(**args)
    with pytest.raises(exc, match=pattern):
        causal_conv1d_bwd(dy=torch.zeros(1, 10, 8, device=DEVICE), deterministic=True, **args)


def test_empty_inputs():
    x, w = torch.zeros(1, 0, 4, device=DEVICE), torch.ones(4, 3, device=DEVICE)
    y = causal_conv1d_fwd(x, w, None, "silu", [0, 0])
    dx, dw, db, dh = causal_conv1d_bwd(x, w, None, x, "silu", [0, 0], deterministic=True)
    assert y.shape == dx.shape == (1, 0, 4) and db is None and dh is None
    assert torch.equal(dw, torch.zeros_like(w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_gpu_against_fp32_torch():
    cu = [0, 1, 3000, 4096, 8192]
    x, w, b, dy, h = _inputs(1, 8192, 384, 4, True, True, dtype=torch.bfloat16, seed=81)
    got = _both(x, w, b, dy, "silu", cu, h)
    want = _torch64(x, w, b, dy, "silu", cu, h)
    for a, r in zip(got, want):
        err = float((a.double() - r).abs().max() / r.abs().max())
        assert err < 2e-2, err
    again = _both(x, w, b, dy, "silu", cu, h)
    assert all(torch.equal(a, c) for a, c in zip(got, again))
