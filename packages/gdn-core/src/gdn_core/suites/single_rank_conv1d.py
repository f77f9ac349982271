"""The causal conv1d against torch.nn.functional.conv1d, one document at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def conv_reference(x, weight, bias, activation, cu_seqlens):
    """Each document (each batch row without ``cu_seqlens``) convolved on its own,
    zero-padded on the left: ``F.conv1d(groups=D, padding=W-1)`` truncated."""
    B, T, D = x.shape
    W = weight.shape[1]
    offs = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    outs = []
    for bos, eos in zip(offs[:-1], offs[1:]):
        if eos == bos:
            continue
        seg = x[:, bos:eos].transpose(1, 2)
        y = F.conv1d(seg, weight.unsqueeze(1), bias, padding=W - 1, groups=D)[..., : eos - bos]
        outs.append(y.transpose(1, 2))
    y = torch.cat(outs, 1)
    return F.silu(y) if activation in ("silu", "swish") else y


def _inputs(B, T, D, W, bias, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen, dtype=dtype)
    w = torch.randn(D, W, generator=gen, dtype=dtype)
    b = torch.randn(D, generator=gen, dtype=dtype) if bias else None
    dy = torch.randn(B, T, D, generator=gen, dtype=dtype)
    return x, w, b, dy


def _grads(fn, x, w, b, dy, **kw):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves, **kw)
    (y * dy).sum().backward()
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("cu", [None, [0, 1, 5, 5, 40, 77], "tensor"])
def test_matches_torch_conv1d(api, W, bias, activation, cu):
    if cu == "tensor":
        cu = torch.tensor([0, 30, 31, 77], dtype=torch.int64)
    x, w, b, dy = _inputs(1, 77, 6, W, bias, seed=W)
    got = _grads(api.conv, x, w, b, dy, activation=activation, cu_seqlens=cu)
    ref = _grads(conv_reference, x, w, b, dy, activation=activation, cu_seqlens=cu)
    for a, r in zip(got, ref):
        if r is None:
            assert a is None
        else:
            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_fixed_length_batch_and_dtypes(api):
    x, w, b, dy = _inputs(3, 50, 8, 4, True, dtype=torch.float32, seed=3)
    got = _grads(api.conv, x, w, b, dy)
    ref = _grads(lambda x, w, b: torch.cat(
        [conv_reference(x[i:i + 1], w, b, "silu", None) for i in range(3)]), x, w, b, dy)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    xb = x.to(torch.bfloat16).requires_grad_()
    y = api.conv(xb, w, b)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16


def test_no_token_sees_a_previous_document(api):
    x, w, b, _ = _inputs(1, 20, 4, 4, True, seed=5)
    cu = [0, 10, 20]
    y = api.conv(x, w, b, None, cu)
    x2 = x.clone()
    x2[:, :10] = 1e6  # changing document 0 must leave document 1 untouched
    y2 = api.conv(x2, w, b, None, cu)
    assert torch.equal(y[:, 10:], y2[:, 10:])


def test_gradcheck(api):
    x, w, b, _ = _inputs(1, 12, 3, 3, True, seed=6)
    leaves = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(
        lambda x, w, b: api.conv(x, w, b, "silu", [0, 2, 7, 12]), leaves)


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(x=torch.zeros(4, 8)), ValueError, r"x must be \[B, T, D\]"),
        (dict(weight=torch.zeros(5, 4)), ValueError, r"weight must be \[D=8, W\]"),
        (dict(weight=torch.zeros(8, 4, dtype=torch.int32)), TypeError, "weight has dtype"),
        (dict(bias=torch.zeros(7)), ValueError, r"bias must have shape \(8,\)"),
        (dict(activation="relu"), ValueError, "activation must be one of"),
        (dict(cu_seqlens=[0, 5]), ValueError, "cu_seqlens must end at T=10"),
        (dict(cu_seqlens=[0, 6, 4, 10]), ValueError, "non-decreasing"),
        (dict(x=torch.zeros(2, 10, 8), cu_seqlens=[0, 10]), ValueError, "B == 1"),
        (dict(x="x"), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_inputs(api, kwargs, exc, pattern):
    args = dict(x=torch.zeros(1, 10, 8), weight=torch.zeros(8, 4), bias=None,
                activation="silu", cu_seqlens=None)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        api.conv(**args)
