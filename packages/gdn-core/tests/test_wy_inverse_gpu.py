"""The WY forward's register inverse (``GDN_CORE_WY_INV=reg``) on the GPU.

bf16 and fp16, K = V = 128, group 1 and 2, packed documents with short last chunks (every
16-row block edge) and 32K tokens in 9 documents: against a float64 triangular solve of
``I + A`` on the rounded inputs (``reference.wy_ref``; ``A_inv`` 1e-5 relative to its
largest entry, ``W``/``U`` the Triton kernel's tolerance: fp16 5e-3, bf16 1e-2) and
against the substitution kernel (the default); bitwise repeatable; the forward's 16-bit
inverse (``A_inv_for_backward``) the bits of the fp32 one rounded, with the same ``W``,
``U``, which ``wy_apply`` reproduces from it; each document's bits the same when it is
launched alone; a NaN in one document's keys leaving the others' bits alone; strong decay
and strongly coupled keys.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.switches import WY_INV_ENV
from gdn_core.testkit import max_rel_err, wy_fp64, wy_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
TOL_A = 1e-5
LENGTHS = [5, 64, 70, 1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 200]
LONG = [1, 4095, 63, 8191, 65, 10000, 3000, 7000, 353]  # 32768 tokens


def _problem(lengths, H, group, dtype, kind="normal", seed=0):
    from gdn_core.ops.cumsum import chunk_cumsum_fwd

    offs, (k, v, beta, g) = wy_inputs(lengths, H, group, 128, 128, kind, seed)
    index = ChunkIndex.build(offs, "cuda")
    k, v, beta = (x.to("cuda", dtype) for x in (k, v, beta))
    G = chunk_cumsum_fwd(g.cuda(), index)
    return offs, index, (k, v, beta, G)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, LONG], ids=["short", "32k-9docs"])
def test_register_inverse_on_the_gpu(lengths, group, dtype, monkeypatch):
    from gdn_core.ops.wy import wy_apply, wy_fwd

    H = 2 if lengths is LENGTHS else 8
    offs, index, (k, v, beta, G) = _problem(lengths, H, group, dtype)
    monkeypatch.setenv(WY_INV_ENV, "reg")
    A_inv, W, U = wy_fwd(k, v, beta, G, index, group)
    assert A_inv.dtype == torch.float32 and W.dtype == dtype and U.dtype == dtype
    again = wy_fwd(k, v, beta, G, index, group)
    assert all(torch.equal(a, b) for a, b in zip(again, (A_inv, W, U)))
    a16, W16, U16 = wy_fwd(k, v, beta, G, index, group, A_inv_for_backward=True)
    assert a16.dtype == dtype and torch.equal(a16, A_inv.to(dtype))
    assert torch.equal(W16, W) and torch.equal(U16, U)
    none, W0, U0 = wy_fwd(k, v, beta, G, index, group, output_A_inv=False)
    assert none is None and torch.equal(W0, W) and torch.equal(U0, U)
    Wa, Ua = wy_apply(k, v, beta, G, a16, index, group)
    assert torch.equal(Wa, W) and torch.equal(Ua, U)
    A_ref, W_ref, U_ref = wy_fp64(k, v, beta, G, offs, group)
    assert max_rel_err(A_inv, A_ref) <= TOL_A
    assert max_rel_err(W, W_ref) <= TOL[dtype]
    assert max_rel_err(U, U_ref) <= TOL[dtype]
    monkeypatch.setenv(WY_INV_ENV, "subst")
    A_s, W_s, U_s = wy_fwd(k, v, beta, G, index, group)
    assert max_rel_err(A_inv, A_s) <= TOL_A
    assert max_rel_err(W, W_s) <= TOL[dtype] and max_rel_err(U, U_s) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_register_inverse_documents_are_independent(dtype, monkeypatch):
    """Each document's bits launched alone equal its rows of the packed launch; a NaN in
    one document's keys leaves every other document's bits unchanged."""
    from gdn_core.ops.wy import wy_fwd

    monkeypatch.setenv(WY_INV_ENV, "reg")
    offs, index, (k, v, beta, G) = _problem(LENGTHS, 2, 1, dtype, seed=1)
    full = wy_fwd(k, v, beta, G, index, 1)
    for bos, eos in zip(offs[:-1], offs[1:]):
        one = ChunkIndex.build([0, eos - bos], "cuda")
        alone = wy_fwd(*(x[bos:eos].contiguous() for x in (k, v, beta, G)), one, 1)
        assert all(torch.equal(a, b[bos:eos]) for a, b in zip(alone, full)), (bos, eos)
    bad = k.clone()
    bad[offs[3] : offs[4]] = float("nan")  # the one-token document after a short chunk
    poisoned = wy_fwd(bad, v, beta, G, index, 1)
    keep = torch.ones(offs[-1], dtype=torch.bool, device="cuda")
    keep[offs[3] : offs[4]] = False
    assert all(torch.equal(a[keep], b[keep]) for a, b in zip(poisoned, full))


@pytest.mark.parametrize("kind", ["decay", "coupled"])
def test_register_inverse_hard_cases_on_the_gpu(kind, monkeypatch):
    from gdn_core.ops.wy import wy_fwd

    offs, index, (k, v, beta, G) = _problem([64, 64, 40, 4096], 4, 1, torch.bfloat16,
                                            kind=kind, seed=2)
    A_ref, W_ref, U_ref = wy_fp64(k, v, beta, G, offs, 1)
    for mode in ("reg", "subst"):
        monkeypatch.setenv(WY_INV_ENV, mode)
        A_inv, W, U = wy_fwd(k, v, beta, G, index, 1)
        assert max_rel_err(A_inv, A_ref) <= TOL_A, mode
        assert max_rel_err(W, W_ref) <= TOL[torch.bfloat16], mode
        assert max_rel_err(U, U_ref) <= TOL[torch.bfloat16], mode
