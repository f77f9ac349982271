"""gdn_core.conv1d: a NaN or Inf in one document never reaches another (issue 20).

A non-finite value is planted in one document's ``x`` (forward and backward),
``dy`` (backward) or the halo (read by the first document only); every other
document's ``y`` and ``dx`` must be bit-for-bit those of a clean run.
``dweight``/``dbias`` sum over all documents, so they are not compared.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.containment import NON_FINITE, assert_other_documents_equal, plant
from gdn_core.conv1d import causal_conv1d, causal_conv1d_bwd, causal_conv1d_fwd

OFFS = [0, 5, 6, 13, 20]  # a one-token document among others
D = 3
BAD = NON_FINITE


def _inputs(W: int, bias: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    T = OFFS[-1]
    x = torch.randn(1, T, D, generator=gen, dtype=dtype)
    w = torch.randn(D, W, generator=gen, dtype=dtype)
    b = torch.randn(D, generator=gen, dtype=dtype) if bias else None
    dy = torch.randn(1, T, D, generator=gen, dtype=dtype)
    halo = torch.randn(1, W - 1, D, generator=gen, dtype=dtype)
    return x, w, b, dy, halo


def _plant(t, doc, value):
    return plant(t, OFFS, doc, value)


def _assert_others_equal(got, clean, doc, what):
    assert_other_documents_equal(got, clean, OFFS, doc, what)


def _run(x, w, b, dy, halo, activation, deterministic):
    y = causal_conv1d_fwd(x, w, b, activation, OFFS, halo, deterministic=deterministic)
    dx, _, _, dhalo = causal_conv1d_bwd(x, w, b, dy, activation, OFFS, halo,
                                        deterministic=deterministic)
    return y, dx, dhalo


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("doc", range(len(OFFS) - 1))
def test_nonfinite_x_stays_in_its_document(W, activation, deterministic, value, doc):
    x, w, b, dy, halo = _inputs(W, bias=True)
    y0, dx0, dh0 = _run(x, w, b, dy, halo, activation, deterministic)
    y, dx, dh = _run(_plant(x, doc, value), w, b, dy, halo, activation, deterministic)
    _assert_others_equal(y, y0, doc, "y")
    _assert_others_equal(dx, dx0, doc, "dx")
    if doc != 0:  # the halo belongs to the first document
        assert torch.equal(dh, dh0), "dhalo"


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("doc", range(len(OFFS) - 1))
def test_nonfinite_dy_stays_in_its_document(W, value, doc):
    x, w, b, dy, halo = _inputs(W, bias=False)
    _, dx0, dh0 = _run(x, w, b, dy, halo, "silu", True)
    _, dx, dh = _run(x, w, b, _plant(dy, doc, value), halo, "silu", True)
    _assert_others_equal(dx, dx0, doc, "dx")
    if doc != 0:
        assert torch.equal(dh, dh0), "dhalo"


@pytest.mark.parametrize("value", BAD)
def test_nonfinite_halo_reaches_only_the_first_document(value):
    x, w, b, dy, halo = _inputs(4, bias=True)
    y0, dx0, _ = _run(x, w, b, dy, halo, "silu", True)
    y, dx, _ = _run(x, w, b, dy, torch.full_like(halo, value), "silu", True)
    _assert_others_equal(y, y0, 0, "y")
    _assert_others_equal(dx, dx0, 0, "dx")


@pytest.mark.parametrize("value", BAD)
def test_nonfinite_doc_pos_path_and_autograd(value):
    """The device-table path (``doc_pos``) and the autograd function keep the same
    containment."""
    x, w, b, dy, _ = _inputs(4, bias=True)
    doc_pos = torch.cat([torch.arange(b_ - a) for a, b_ in zip(OFFS[:-1], OFFS[1:])])
    bad = _plant(x, 1, value)
    y = causal_conv1d_fwd(bad, w, b, "silu", doc_pos=doc_pos)
    y0 = causal_conv1d_fwd(x, w, b, "silu", doc_pos=doc_pos)
    _assert_others_equal(y, y0, 1, "y (doc_pos)")
    dx = causal_conv1d_bwd(bad, w, b, dy, "silu", doc_pos=doc_pos, deterministic=True)[0]
    dx0 = causal_conv1d_bwd(x, w, b, dy, "silu", doc_pos=doc_pos, deterministic=True)[0]
    _assert_others_equal(dx, dx0, 1, "dx (doc_pos)")
    leaves = [t.clone().requires_grad_() for t in (x, bad)]
    ys = [causal_conv1d(t, w, b, "silu", OFFS, deterministic=True) for t in leaves]
    for y in ys:
        y.backward(dy)
    _assert_others_equal(ys[1].detach(), ys[0].detach(), 1, "y (autograd)")
    _assert_others_equal(leaves[1].grad, leaves[0].grad, 1, "dx (autograd)")
