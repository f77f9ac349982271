"""The Gluon WY apply launcher (``wy_apply_gluon``, the backward's W, U from the stored
inverse) without a GPU: it imports, it is declared atomic-free, its signature is
:func:`~gdn_core.ops.wy.wy_apply`'s, it refuses what it does not serve (``ValueError``)
and devices it cannot run on (``RuntimeError``) before compiling anything; it shares the
W/U operand and product code with the WY forward; and the kernel's dataflow (whole
64-row TMA tiles of K, V and ``A_inv``, rows past a short chunk holding the next
document's values, the operand rows >= n selected to 0, the two products, rows < n
stored), emulated in torch, against the fp64 reference, with the kernel's 16-bit operand
rounding against the Triton :func:`~gdn_core.ops.wy.wy_apply` (interpreted), and with
NaN in the next document's rows. The kernel itself: ``*_gpu.py``."""

from __future__ import annotations

import inspect

import pytest
import torch
from gdn_core import reference as R
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import wy as triton_wy
from gdn_core.ops.gluon import wy as gw


def _args(T=70, H=1, group=2, K=128, V=128, dtype=torch.bfloat16, v_dtype=None,
          a_dtype=None):
    index = ChunkIndex.build([0, T], "cpu")
    HV = H * group
    return (torch.zeros(T, H, K, dtype=dtype), torch.zeros(T, HV, V, dtype=v_dtype or dtype),
            torch.zeros(T, HV, dtype=dtype), torch.zeros(T, HV),
            torch.zeros(T, HV, 64, dtype=a_dtype or dtype), index, group)


def test_declared_atomic_free():
    info = gw.wy_apply_gluon.launcher_info
    assert info.uses_atomics is False and info.kernels == (gw._wy_apply_gluon_kernel,)


def test_signature_is_wy_apply_s():
    got = inspect.signature(gw.wy_apply_gluon).parameters
    want = inspect.signature(triton_wy.wy_apply).parameters
    assert [(p.name, p.kind, p.default) for p in got.values()] == \
        [(p.name, p.kind, p.default) for p in want.values()]


def test_shares_the_operand_and_product_code_with_the_forward():
    """One piece of code where the logic is the same: both kernels build the W/U operands
    with ``_scale_rows`` and take the products and stores from ``_wu_products``."""
    for kernel in (gw._wy_fwd_gluon_kernel, gw._wy_apply_gluon_kernel):
        src = inspect.getsource(kernel.fn if hasattr(kernel, "fn") else kernel)
        assert src.count("_scale_rows(") == 2 and src.count("_wu_products(") == 1


@pytest.mark.parametrize("kw", [dict(K=64), dict(V=64), dict(dtype=torch.float32),
                                dict(v_dtype=torch.float16), dict(a_dtype=torch.float16),
                                dict(a_dtype=torch.float64)])
def test_unsupported_shapes_and_dtypes_raise_value_error(kw):
    k, v, beta, G, A_inv, index, group = _args(**kw)
    assert not gw.gluon_wy_apply_supported(k, v, A_inv, index)
    with pytest.raises(ValueError):
        gw.wy_apply_gluon(k, v, beta, G, A_inv, index, group)


def test_other_chunk_size_raises_value_error():
    k, v, beta, G, A_inv, _, group = _args()
    index = ChunkIndex.build([0, 70], "cpu", chunk_size=32)
    assert not gw.gluon_wy_apply_supported(k, v, A_inv, index)
    with pytest.raises(ValueError, match="chunks of 64"):
        gw.wy_apply_gluon(k, v, beta, G, A_inv, index, group)


def test_mismatched_shapes_raise_value_error():
    k, v, beta, G, A_inv, index, group = _args()
    with pytest.raises(ValueError, match="shape mismatch"):
        gw.wy_apply_gluon(k, v, beta[:-1], G, A_inv, index, group)
    with pytest.raises(ValueError, match="shape mismatch"):
        gw.wy_apply_gluon(k, v, beta, G, A_inv, index, group + 1)
    with pytest.raises(ValueError, match="A_inv must be"):
        gw.wy_apply_gluon(k, v, beta, G, A_inv[:, :1], index, group)
    with pytest.raises(ValueError, match="A_inv must be"):
        gw.wy_apply_gluon(k, v, beta, G, A_inv[..., :32], index, group)


@pytest.mark.parametrize("a_dtype", [torch.bfloat16, torch.float32])
def test_cpu_tensors_raise_runtime_error(a_dtype):
    k, v, beta, G, A_inv, index, group = _args(a_dtype=a_dtype)
    assert gw.gluon_wy_apply_supported(k, v, A_inv, index)
    with pytest.raises(RuntimeError):
        gw.wy_apply_gluon(k, v, beta, G, A_inv, index, group)


# ------------------------------------------------- the kernel's dataflow, emulated


def _emulate(k, v, beta, G, A_inv, index, group, dt16=None):
    """The kernel's steps in torch, one (chunk, value head) at a time, fp64 arithmetic:
    whole 64-row tiles of K, V and ``A_inv`` as TMA reads them (rows past the chunk are
    the next rows of the tensor, zeros past ``T``), ``g``/``β`` read 0 past ``n``, the
    operands ``diag(β e^G) K`` and ``diag(β) V`` with rows >= n selected to 0, ``W =
    A_inv · Y_K``, ``U = A_inv · Y_V``, rows < n stored. ``dt16``: the kernel's 16-bit
    rounding of the operands (the products then rounded to it too); else none."""
    T, H, K = k.shape
    HV, V = v.shape[1:]
    f64 = torch.float64
    rnd = (lambda x: x.to(dt16).to(f64)) if dt16 is not None else (lambda x: x)
    W, U = torch.zeros(T, HV, K, dtype=f64), torch.zeros(T, HV, V, dtype=f64)
    r = torch.arange(64)
    zero = torch.zeros((), dtype=f64)

    def tile(x, bos, head):  # TMA: 64 rows from bos, zero-filled past T
        t = torch.zeros(64, x.shape[-1], dtype=f64)
        rows = x[bos:bos + 64, head].to(f64)
        t[:rows.shape[0]] = rows
        return t

    for c in range(index.num_chunks):
        bos, n = int(index.chunk_start[c]), int(index.chunk_len[c])
        for hv in range(HV):
            Kt, Vt, At = tile(k, bos, hv // group), tile(v, bos, hv), rnd(tile(A_inv, bos, hv))
            valid = r < n
            g = torch.where(valid, tile(G[..., None], bos, hv)[:, 0], zero)
            b = torch.where(valid, tile(beta[..., None], bos, hv)[:, 0], zero)
            yk = rnd(torch.where(valid[:, None], Kt * (b * g.exp())[:, None], zero))
            yv = rnd(torch.where(valid[:, None], Vt * b[:, None], zero))
            W[bos:bos + n, hv] = rnd(At @ yk)[:n]
            U[bos:bos + n, hv] = rnd(At @ yv)[:n]
    return W, U


def _problem(lengths, group, dtype=torch.float64, seed=7):
    gen = torch.Generator().manual_seed(seed)
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    bounds = list(zip(offs[:-1], offs[1:]))
    index = ChunkIndex.build(offs, "cpu")
    T, H, D = offs[-1], 1, 128
    HV = H * group
    f64 = torch.float64
    k = torch.nn.functional.normalize(torch.randn(T, H, D, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(T, HV, D, generator=gen, dtype=f64)
    beta = torch.rand(T, HV, generator=gen, dtype=f64)
    g = torch.nn.functional.logsigmoid(torch.randn(T, HV, generator=gen, dtype=f64) + 2.0)
    k, v, beta = (x.to(dtype) for x in (k, v, beta))
    G = R.chunk_cumsum_ref(g, bounds).to(torch.float64 if dtype == f64 else torch.float32)
    return offs, bounds, index, k, v, beta, G


LENGTHS = [5, 64, 70, 17, 49]


@pytest.mark.parametrize("lengths,group", [(LENGTHS, 2), ([130], 1), ([1, 63, 65], 1)])
def test_kernel_dataflow_matches_reference(lengths, group):
    """fp64: the reference's inverse in, its W, U out; packed documents with short last
    chunks (the next document's rows in the tiles past n)."""
    offs, bounds, index, k, v, beta, G = _problem(lengths, group)
    A_ref, W_ref, U_ref = R.wy_ref(k.repeat_interleave(group, 1), v, beta, G, bounds)
    W, U = _emulate(k, v, beta, G, A_ref, index, group)
    for name, a, w in (("W", W, W_ref), ("U", U, U_ref)):
        err = ((a - w).abs().max() / w.abs().max()).item()
        assert err <= 1e-12, f"{name}: {err:.3e}"


def test_nan_in_the_next_documents_rows_stays_there():
    """NaN/inf in the first row of documents 1 and 3 (K, V, β, G and ``A_inv``: the rows
    the short chunk before each reads past its end) changes no other document's W, U:
    the operand rows >= n are selected to 0, ``A_inv``'s rows >= n reach only rows >= n."""
    group = 2
    offs, bounds, index, k, v, beta, G = _problem(LENGTHS, group)
    A_ref = R.wy_ref(k.repeat_interleave(group, 1), v, beta, G, bounds)[0]
    W, U = _emulate(k, v, beta, G, A_ref, index, group)
    for d in (1, 3):
        row = offs[d]
        bad = [x.clone() for x in (k, v, beta, G, A_ref)]
        for x, val in zip(bad, ("nan", "inf", "nan", "nan", "nan")):
            x[row] = float(val)
        W2, U2 = _emulate(bad[0], bad[1], bad[2], bad[3], bad[4], index, group)
        for x, y in ((W2, W), (U2, U)):
            assert torch.equal(x[:offs[d]], y[:offs[d]]), f"document {d} leaked backwards"
            assert torch.equal(x[offs[d + 1]:], y[offs[d + 1]:])
            assert torch.isnan(x[row]).any()  # the poisoned document itself does see it


def test_zeroing_matters():
    """Without the select of rows >= n (``0 · NaN``: multiplying by the masked β instead)
    the NaN would reach the short chunk before it: the select is what contains it."""
    group = 1
    offs, bounds, index, k, v, beta, G = _problem([5, 64], group)
    bad_k = k.clone()
    bad_k[offs[1]] = float("nan")
    r = torch.arange(64)
    b = torch.where(r < 5, torch.cat([beta[:, 0], beta.new_zeros(64)])[:64], 0.0)
    Kt = bad_k[:64, 0]
    assert torch.isnan(Kt * b[:, None]).any()  # the product alone: 0 · NaN
    A_ref = R.wy_ref(k, v, beta, G, bounds)[0]
    W, _ = _emulate(bad_k, v, beta, G, A_ref, index, group)
    assert torch.isfinite(W[:5]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_fp32", [False, True])
def test_rounded_dataflow_matches_reference_and_triton_wy_apply(dtype, a_fp32):
    """16-bit inputs, the backward's 16-bit inverse (or fp32, which the launcher rounds as
    the Triton kernel does): the emulation with the kernel's operand rounding against the
    fp64 reference and, for fp16, the Triton ``wy_apply`` interpreted on the CPU (the
    interpreter's bf16 dots are not faithful: the repo's CPU tests take no bf16 dot; the
    GPU file compares bf16 with Triton)."""
    group = 2
    offs, bounds, index, k, v, beta, G = _problem(LENGTHS, group, dtype=dtype, seed=3)
    A_ref, W_ref, U_ref = R.wy_ref(k.double().repeat_interleave(group, 1), v.double(),
                                   beta.double(), G.double(), bounds)
    A = A_ref.float()
    A_in = A if a_fp32 else triton_wy.inverse_for_backward(A, k, v)
    assert A_in.dtype == (torch.float32 if a_fp32 else dtype)
    W, U = _emulate(k, v, beta, G, A_in, index, group, dt16=dtype)
    tol = {torch.bfloat16: 1e-2, torch.float16: 5e-3}[dtype]
    outs = {"W": (W, W_ref), "U": (U, U_ref)}
    for name, (a, w) in outs.items():
        assert ((a - w).abs().max() / w.abs().max()).item() <= tol, name
    if dtype == torch.float16:
        W_tr, U_tr = triton_wy.wy_apply(k, v, beta, G, A_in, index, group)
        for (name, (a, w)), t in zip(outs.items(), (W_tr, U_tr)):
            # the same operand bits, fp32 vs fp64 sums: within an output ulp or so
            assert ((a - t.double()).abs().max() / w.abs().max()).item() <= 2e-3, name
