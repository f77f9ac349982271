"""The state kernel on the chunk inverse (issue 19) against the ``W``/``U`` formulation.

:func:`~gdn_core.ops.chunk_state.chunk_state_fwd` reads ``A_inv``, ``v`` and
``beta`` and forms ``v_new = A_inv diag(β)(V − diag(e^G) K S)`` in its chunk
loop; the fp32 reference walks ``v_new = U − W S`` with ``W``, ``U`` from
:func:`gdn_core.reference.wy_ref`. The two are the same algebra: here they must
agree within the stage tests' tolerances, on packed documents with partial last
chunks, grouped value heads, an initial state, the ``[E | M]`` summary state,
and a non-finite input must stay inside its document, bit for bit.

Runs under the Triton interpreter (fp32/fp16; bf16 dots are wrong there).
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import chunk_state_fwd, inverse_for_backward, wy_fwd

TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
# packed documents: partial last chunks (130 = 2·64 + 2, 77), a one-token one, a full chunk
LENGTHS = [130, 1, 64, 77]
DIMS = [(1, 2, 32, 32), (2, 4, 16, 48)]  # (H, HV, K, V): grouped value heads


def _offsets(lengths):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return offs


def _bounds(offs):
    return list(zip(offs[:-1], offs[1:]))


def _rel_err(a, b):
    a, b = a.double(), b.double()
    assert a.shape == b.shape and torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _check(name, a, b, tol):
    err = _rel_err(a, b)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def _problem(lengths, H, HV, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offs = _offsets(lengths)
    T = offs[-1]
    k = R.l2_normalize(torch.randn(T, H, K, generator=gen)).to(dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dtype)
    g = -torch.rand(T, HV, generator=gen) * 0.3 - 0.01
    beta = (torch.rand(T, HV, generator=gen) * 0.9 + 0.05).to(dtype)
    h0 = torch.randn(len(lengths), HV, K, V, generator=gen)
    index = ChunkIndex.build(offs, "cpu")
    G = R.chunk_cumsum_ref(g, _bounds(offs))
    return offs, k, v, beta, G, h0, index


def _inverse(k, v, beta, G, index, group):
    """The forward's inverse: the kernel's, as the later stages read it."""
    A_inv, W = wy_fwd(k, beta, G, index, group)
    assert W is None
    return inverse_for_backward(A_inv, k, v)


def _reference_wu(k, v, beta, G, offs, group):
    ke = k.float().repeat_interleave(group, dim=1)
    _, W, U = R.wy_ref(ke, v.float(), beta.float(), G, _bounds(offs))
    return ke, W, U


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_h0", [True, False])
def test_state_from_the_inverse_is_the_wu_recurrence(dims, dtype, with_h0):
    H, HV, K, V = dims
    group = HV // H
    offs, k, v, beta, G, h0, index = _problem(LENGTHS, H, HV, K, V, dtype, seed=1)
    h0 = h0 if with_h0 else None
    A_inv = _inverse(k, v, beta, G, index, group)
    assert A_inv.dtype == dtype  # 16-bit inputs: the inverse in their dtype
    h, v_new, final = chunk_state_fwd(k, A_inv, v, beta, G, index, group, h0,
                                      output_final_state=True)
    ke, W, U = _reference_wu(k, v, beta, G, offs, group)
    h_ref, vn_ref, f_ref = R.chunk_states_ref(ke, W, U, G, _bounds(offs), h0)
    assert h.dtype == dtype and v_new.dtype == dtype and final.dtype == torch.float32
    _check("h", h, h_ref, TOL[dtype])
    _check("v_new", v_new, vn_ref, TOL[dtype])
    _check("final", final, f_ref, TOL[dtype])
    # deterministic: the same call twice gives the same bits
    again = chunk_state_fwd(k, A_inv, v, beta, G, index, group, h0, output_final_state=True)
    for a, b in zip((h, v_new, final), again):
        assert torch.equal(a, b)
    # the fp32 inverse gives the bits of the 16-bit one (the dot rounds it anyway)
    if dtype != torch.float32:
        A32, _ = wy_fwd(k, beta, G, index, group)
        for a, b in zip((h, v_new, final),
                        chunk_state_fwd(k, A32, v, beta, G, index, group, h0,
                                        output_final_state=True)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_summary_state_from_the_inverse(dtype):
    """``state_width = V + K``, ``identity_state``: ``[E | M]`` with the ``M`` columns
    taking ``v = 0`` — ``E`` is the zero-start recurrence, ``M`` the one of ``U = 0``
    from the identity."""
    H, HV, K, V = 1, 2, 16, 32
    offs, k, v, beta, G, _, index = _problem(LENGTHS, H, HV, K, V, dtype, seed=2)
    A_inv = _inverse(k, v, beta, G, index, 2)
    h, vn, both = chunk_state_fwd(k, A_inv, v, beta, G, index, 2, output_final_state=True,
                                  store_states=False, store_v_new=False, state_width=V + K,
                                  identity_state=True)
    assert h is None and vn is None and both.shape == (len(LENGTHS), HV, K, V + K)
    ke, W, U = _reference_wu(k, v, beta, G, offs, 2)
    bounds = _bounds(offs)
    _, _, E_ref = R.chunk_states_ref(ke, W, U, G, bounds, None)
    eye = torch.eye(K).expand(len(LENGTHS), HV, K, K)
    _, _, M_ref = R.chunk_states_ref(ke, W, torch.zeros_like(W), G, bounds, eye)
    _check("E", both[..., :V], E_ref, TOL[dtype])
    _check("M", both[..., V:], M_ref, TOL[dtype])
    # the E columns are the plain launch's bits (value columns are independent programs)
    _, _, E = chunk_state_fwd(k, A_inv, v, beta, G, index, 2, output_final_state=True,
                              store_states=False, store_v_new=False)
    torch.testing.assert_close(both[..., :V], E, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["v_inf", "beta_nan", "k_nan"])
def test_a_non_finite_input_stays_in_its_document(bad):
    """One document's non-finite input (through the WY kernel's inverse and the
    state kernel) leaves every other document's states, v_new and final state,
    and its ``[E | M]`` summary, bitwise equal to a clean run."""
    H, HV, K, V, dtype = 1, 2, 16, 32, torch.float16
    offs, k, v, beta, G, h0, index = _problem(LENGTHS, H, HV, K, V, dtype, seed=3)
    poisoned = 3  # the last document (77 tokens, a partial last chunk)
    row = offs[poisoned] + 70
    kb, vb, bb = k.clone(), v.clone(), beta.clone()
    if bad == "v_inf":
        vb[row, 1, 5] = float("inf")
    elif bad == "beta_nan":
        bb[row, 0] = float("nan")
    else:
        kb[row, 0, 3] = float("nan")

    def run(k, v, beta):
        A_inv = _inverse(k, v, beta, G, index, 2)
        main = chunk_state_fwd(k, A_inv, v, beta, G, index, 2, h0, output_final_state=True)
        _, _, summ = chunk_state_fwd(k, A_inv, v, beta, G, index, 2, output_final_state=True,
                                     store_states=False, store_v_new=False,
                                     state_width=V + K, identity_state=True)
        return main, summ

    (h, vn, fin), summ = run(k, v, beta)
    (hb, vnb, finb), summb = run(kb, vb, bb)
    assert not torch.isfinite(finb[poisoned]).all()  # it did reach its own document
    chunks = index.doc_chunk_offsets.tolist()
    for n in range(len(LENGTHS)):
        if n == poisoned:
            continue
        a, b = offs[n], offs[n + 1]
        c0, c1 = chunks[n], chunks[n + 1]
        assert torch.equal(hb[c0:c1], h[c0:c1]), n
        assert torch.equal(vnb[a:b], vn[a:b]), n
        assert torch.equal(finb[n], fin[n]), n
        assert torch.equal(summb[n], summ[n]), n


def test_rejects_a_wrong_inverse():
    H, HV, K, V = 1, 2, 16, 16
    offs, k, v, beta, G, _, index = _problem([70], H, HV, K, V, torch.float16)
    A_inv = _inverse(k, v, beta, G, index, 2)
    with pytest.raises(ValueError, match=r"A_inv must be \[T, HV, 64\]"):
        chunk_state_fwd(k, A_inv[:, :, :32], v, beta, G, index, 2)
    with pytest.raises(ValueError, match=r"got .* torch.bfloat16"):
        chunk_state_fwd(k, A_inv.bfloat16(), v, beta, G, index, 2)
    with pytest.raises(ValueError, match="shape mismatch"):
        chunk_state_fwd(k, A_inv, v, beta[:, :1], G, index, 2)
