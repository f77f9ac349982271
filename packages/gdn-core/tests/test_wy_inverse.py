"""The WY forward's register inverse (``GDN_CORE_WY_INV=reg``) under the interpreter.

Against the float64 reference of the stage (``reference.wy_ref`` on the rounded inputs,
i.e. a float64 triangular solve of ``I + A``) and against the substitution kernel (the
default): packed documents with short last chunks on and around every 16-row block edge,
grouped heads, ``K``/``V`` of 48 (not a power of two), fp32 and fp16 (bf16 dots are wrong
in the interpreter; the GPU test covers bf16), normal, strong (``-40·softplus``) decay and
strongly coupled keys. Bits repeat; ``wy_apply`` on the register inverse gives its ``W``,
``U`` bits (phase 3 is the same function of ``A_inv``); the switch defaults to the
substitution kernel and refuses unknown names.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import inverse_for_backward, wy_apply, wy_fwd
from gdn_core.ops.wy import wy_inverse_choice
from gdn_core.switches import WY_INV_ENV
from gdn_core.testkit import max_rel_err, wy_fp64, wy_inputs

# every 16-row block edge, a full chunk, and a document of three chunks (short last)
LENGTHS = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 150]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
TOL_A = 1e-5


def _problem(lengths, H, group, K, V, dtype, kind="normal", seed=0):
    offs, (k, v, beta, g) = wy_inputs(lengths, H, group, K, V, kind, seed)
    k, v, beta = (x.to(dtype) for x in (k, v, beta))
    bounds = list(zip(offs[:-1], offs[1:]))
    G = R.chunk_cumsum_ref(g, bounds)
    return offs, bounds, ChunkIndex.build(offs, "cpu"), (k, v, beta, G)


@pytest.mark.parametrize("dims", [(1, 2, 48, 32), (2, 2, 16, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_register_inverse_matches_fp64_and_the_substitution(dims, dtype, monkeypatch):
    H, HV, K, V = dims
    group = HV // H
    offs, bounds, index, (k, v, beta, G) = _problem(LENGTHS, H, group, K, V, dtype)
    monkeypatch.setenv(WY_INV_ENV, "reg")
    A_inv, W, U = wy_fwd(k, v, beta, G, index, group)
    assert A_inv.dtype == torch.float32 and W.dtype == dtype and U.dtype == dtype
    again = wy_fwd(k, v, beta, G, index, group)
    assert all(torch.equal(a, b) for a, b in zip(again, (A_inv, W, U)))
    A_ref, W_ref, U_ref = wy_fp64(k, v, beta, G, offs, group)
    assert max_rel_err(A_inv, A_ref) <= TOL_A
    assert max_rel_err(W, W_ref) <= TOL[dtype]
    assert max_rel_err(U, U_ref) <= TOL[dtype]
    # columns past each chunk's length are exactly zero
    for bos, eos in bounds:
        for start in range(bos, eos, 64):
            assert (A_inv[start : min(start + 64, eos), :, min(64, eos - start) :] == 0).all()
    # phase 3 is the substitution kernel's: wy_apply on this inverse gives these bits
    W2, U2 = wy_apply(k, v, beta, G, A_inv, index, group)
    assert torch.equal(W2, W) and torch.equal(U2, U)
    monkeypatch.setenv(WY_INV_ENV, "subst")
    A_s, W_s, U_s = wy_fwd(k, v, beta, G, index, group)
    assert max_rel_err(A_inv, A_s) <= TOL_A
    assert max_rel_err(W, W_s) <= TOL[dtype] and max_rel_err(U, U_s) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_register_inverse_outputs_as_the_forward_asks(dtype, monkeypatch):
    """``output_A_inv=False`` (no fp32 inverse written) and ``A_inv_for_backward=True``
    (the 16-bit copy only, the bits of ``inverse_for_backward`` of the fp32 one) leave
    ``W``, ``U`` as they are."""
    offs, bounds, index, (k, v, beta, G) = _problem([63, 64, 70], 1, 2, 32, 16, dtype, seed=2)
    monkeypatch.setenv(WY_INV_ENV, "reg")
    A_inv, W, U = wy_fwd(k, v, beta, G, index, 2)
    none, W2, U2 = wy_fwd(k, v, beta, G, index, 2, output_A_inv=False)
    assert none is None and torch.equal(W2, W) and torch.equal(U2, U)
    saved, W3, U3 = wy_fwd(k, v, beta, G, index, 2, A_inv_for_backward=True)
    want = inverse_for_backward(A_inv, k, v)
    assert saved.dtype == want.dtype and torch.equal(saved, want)
    assert torch.equal(W3, W) and torch.equal(U3, U)
    W4, U4 = wy_apply(k, v, beta, G, saved, index, 2)
    assert torch.equal(W4, W) and torch.equal(U4, U)


@pytest.mark.parametrize("kind", ["decay", "coupled"])
def test_register_inverse_hard_cases(kind, monkeypatch):
    """Strong decay (``g = -40·softplus``: ``A`` nearly diagonal, ``W`` tiny) and strongly
    coupled keys (inverse entries far from the identity's): within the float64
    reference's tolerance, as the substitution kernel is."""
    offs, bounds, index, (k, v, beta, G) = _problem([64, 64, 40], 1, 1, 64, 32,
                                                    torch.float32, kind=kind, seed=3)
    A_ref, W_ref, U_ref = wy_fp64(k, v, beta, G, offs, 1)
    for mode in ("reg", "subst"):
        monkeypatch.setenv(WY_INV_ENV, mode)
        A_inv, W, U = wy_fwd(k, v, beta, G, index, 1)
        assert max_rel_err(A_inv, A_ref) <= 1e-5, mode
        assert max_rel_err(W, W_ref) <= 1e-5, mode
        assert max_rel_err(U, U_ref) <= 1e-5, mode


def test_inverse_switch(monkeypatch):
    monkeypatch.delenv(WY_INV_ENV, raising=False)
    assert wy_inverse_choice() == "subst"
    offs, bounds, index, (k, v, beta, G) = _problem([70], 1, 1, 16, 16, torch.float32)
    default = wy_fwd(k, v, beta, G, index, 1)
    monkeypatch.setenv(WY_INV_ENV, "subst")
    assert all(torch.equal(a, b) for a, b in zip(wy_fwd(k, v, beta, G, index, 1), default))
    monkeypatch.setenv(WY_INV_ENV, "regs")
    with pytest.raises(ValueError, match="GDN_CORE_WY_INV='regs': expected one of subst, reg"):
        wy_fwd(k, v, beta, G, index, 1)
