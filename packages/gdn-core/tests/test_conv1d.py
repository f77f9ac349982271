"""gdn_core.conv1d: causal depthwise conv1d against torch.nn.functional.conv1d,
document boundaries, the context-parallel halo, and the fixed-order reductions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gdn_core.conv1d import (
    CausalConv1dFunction,
    causal_conv1d,
    causal_conv1d_bwd,
    causal_conv1d_fwd,
)

F64 = torch.float64


def conv_reference(x, weight, bias, activation, cu_seqlens, halo=None):
    """Per document ``F.conv1d(groups=D)``; the first document of each row reads
    ``halo`` (else zeros) before its first token, the others zeros."""
    B, T, D = x.shape
    W = weight.shape[1]
    offs = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    rows = []
    for b in range(B):
        outs = []
        first = True
        for bos, eos in zip(offs[:-1], offs[1:]):
            if eos == bos:
                continue
            if first:
                left = halo[b] if halo is not None else x.new_zeros(W - 1, D)
                first = False
            else:
                left = x.new_zeros(W - 1, D)
            seg = torch.cat([left, x[b, bos:eos]]).T.unsqueeze(0)
            outs.append(F.conv1d(seg, weight.unsqueeze(1), bias, groups=D)[0].T)
        rows.append(torch.cat(outs))
    y = torch.stack(rows)
    return F.silu(y) if activation in ("silu", "swish") else y


def _rand(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _grads(fn, tensors, dy):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    (y * dy).sum().backward()
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def _close(got, ref, tol=1e-10):
    for a, r in zip(got, ref):
        if r is None:
            assert a is None
        else:
            torch.testing.assert_close(a, r, rtol=tol, atol=tol)


@pytest.mark.parametrize("W", [1, 3, 4])
@pytest.mark.parametrize("with_halo", [False, True])
@pytest.mark.parametrize("cu", [None, [0, 2, 2, 30, 31, 50]])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("deterministic", [True, False])
def test_against_torch_conv1d(W, with_halo, cu, activation, deterministic):
    D = 5
    x, w, b, dy = _rand(1, 50, D, seed=1), _rand(D, W, seed=2), _rand(D, seed=3), _rand(
        1, 50, D, seed=4)
    halo = _rand(1, W - 1, D, seed=5) if with_halo else None
    got = _grads(lambda x, w, b, h: causal_conv1d(x, w, b, activation, cu, h,
                                                  deterministic=deterministic),
                 (x, w, b, halo), dy)
    ref = _grads(lambda x, w, b, h: conv_reference(x, w, b, activation, cu, h),
                 (x, w, b, halo), dy)
    _close(got, ref)


def test_fixed_length_batch_with_halo():
    B, T, D, W = 3, 20, 4, 4
    x, w, dy, halo = _rand(B, T, D, seed=6), _rand(D, W, seed=7), _rand(B, T, D, seed=8), _rand(
        B, W - 1, D, seed=9)
    got = _grads(lambda x, w, h: causal_conv1d(x, w, None, "silu", None, h), (x, w, halo), dy)
    ref = _grads(lambda x, w, h: conv_reference(x, w, None, "silu", None, h), (x, w, halo), dy)
    _close(got, ref)


def test_empty_first_document_halo_goes_to_the_document_at_token_0():
    x, w, halo = _rand(1, 10, 2, seed=10), _rand(2, 3, seed=11), _rand(1, 2, 2, seed=12)
    y = causal_conv1d_fwd(x, w, None, None, [0, 0, 4, 10], halo)
    ref = conv_reference(x, w, None, None, [0, 0, 4, 10], halo)
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("cut", [2, 7, 33])
def test_sharded_with_halo_equals_whole(cut):
    """Context parallelism: rank 1 gets tokens [cut, T) and as halo the W-1 tokens
    before the cut that belong to the same document (zero-padded where that
    document started later); its dhalo, added to rank 0's dx, gives the whole dx."""
    T, D, W = 60, 3, 4
    cu = [0, 5, 30, 60]
    x, w, b, dy = _rand(1, T, D, seed=13), _rand(D, W, seed=14), _rand(D, seed=15), _rand(
        1, T, D, seed=16)
    whole = _grads(lambda x, w, b: causal_conv1d(x, w, b, "silu", cu, deterministic=True),
                   (x, w, b), dy)
    doc_start = max(s for s in cu[:-1] if s <= cut)
    halo = x.new_zeros(1, W - 1, D)
    lo = max(cut - (W - 1), doc_start)
    if cut > lo:
        halo[:, W - 1 - (cut - lo):] = x[:, lo:cut]
    cu0 = [c for c in cu if c < cut] + [cut]
    cu1 = [0] + [c - cut for c in cu if c > cut]
    y0, dx0, dw0, db0, _ = _grads(
        lambda x, w, b, h: causal_conv1d(x, w, b, "silu", cu0, h, deterministic=True),
        (x[:, :cut], w, b, None), dy[:, :cut])
    y1, dx1, dw1, db1, dh1 = _grads(
        lambda x, w, b, h: causal_conv1d(x, w, b, "silu", cu1, h, deterministic=True),
        (x[:, cut:], w, b, halo), dy[:, cut:])
    torch.testing.assert_close(torch.cat([y0, y1], 1), whole[0])
    dx = torch.cat([dx0, dx1], 1)
    # the slots that held real tokens send their gradient back; padding slots'
    # gradients are dropped by the caller
    dx[:, lo:cut] += dh1[:, W - 1 - (cut - lo):]
    torch.testing.assert_close(dx, whole[1])
    torch.testing.assert_close(dw0 + dw1, whole[2])
    torch.testing.assert_close(db0 + db1, whole[3])


def test_explicit_bwd_returns_none_for_absent_bias_and_halo():
    x, w, dy = _rand(1, 9, 2, seed=17), _rand(2, 3, seed=18), _rand(1, 9, 2, seed=19)
    dx, dw, db, dh = causal_conv1d_bwd(x, w, None, dy, "silu", deterministic=True)
    assert db is None and dh is None and dx.shape == x.shape and dw.shape == w.shape


def test_deterministic_bitwise_and_matches_plain_sum():
    T, D = 4100, 8  # 5 token blocks, the last one short
    x, w, b = _rand(1, T, D, seed=20, dtype=torch.float32), _rand(D, 4, seed=21,
                                                                  dtype=torch.float32), None
    dy = _rand(1, T, D, seed=22, dtype=torch.float32)
    cu = [0, 1000, 4100]
    runs = [causal_conv1d_bwd(x, w, b, dy, "silu", cu, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert (a is None and c is None) or torch.equal(a, c)
    fast = causal_conv1d_bwd(x, w, b, dy, "silu", cu, deterministic=False)
    torch.testing.assert_close(runs[0][1], fast[1], rtol=1e-4, atol=1e-3)


def test_gradcheck_with_halo_and_documents():
    x, w, b, h = _rand(1, 11, 2, seed=23), _rand(2, 3, seed=24), _rand(2, seed=25), _rand(
        1, 2, 2, seed=26)
    leaves = [t.requires_grad_() for t in (x, w, b, h)]
    assert torch.autograd.gradcheck(
        lambda x, w, b, h: CausalConv1dFunction.apply(x, w, b, h, "silu", [0, 4, 11], True),
        leaves)


def test_low_precision_dtypes():
    x = _rand(1, 30, 4, seed=27, dtype=torch.float32).to(torch.bfloat16).requires_grad_()
    w = _rand(4, 4, seed=28, dtype=torch.float32).requires_grad_()
    h = torch.zeros(1, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    y = causal_conv1d(x, w, None, "silu", None, h)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert h.grad.dtype == torch.bfloat16
    ref = conv_reference(x.detach().double(), w.detach().double(), None, "silu", None)
    assert (y.double() - ref).abs().max() < 3e-2


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(halo=torch.zeros(1, 2, 8)), ValueError, r"halo must have shape \(B=1, W-1=3, D=8\)"),
        (dict(halo=torch.zeros(1, 3, 8, dtype=torch.int64)), TypeError, "halo has dtype"),
        (dict(weight=torch.zeros(8, 0)), ValueError, "weight must be"),
        (dict(x=torch.zeros(1, 10, 8, dtype=torch.int32)), TypeError, "x has dtype"),
        (dict(bias=torch.zeros(8, device="meta")), ValueError, "one device"),
        (dict(cu_seqlens=torch.tensor([[0, 10]])), ValueError, "cu_seqlens must be 1-D"),
        (dict(cu_seqlens=[1, 10]), ValueError, "cu_seqlens must start at 0"),
        (dict(cu_seqlens="0,10"), TypeError, "cu_seqlens must be a tensor"),
    ],
)
def test_bad_inputs(kwargs, exc, pattern):
    args = dict(x=torch.zeros(1, 10, 8), weight=torch.zeros(8, 4), bias=None,
                activation="silu", cu_seqlens=None, halo=None)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        causal_conv1d(**args)


def test_bwd_checks_dy():
    x, w = torch.zeros(1, 10, 8), torch.zeros(8, 4)
    with pytest.raises(ValueError, match="dy must match x"):
        causal_conv1d_bwd(x, w, None, torch.zeros(1, 9, 8), deterministic=True)
