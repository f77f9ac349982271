"""Fail closed (issue 20): values and states the GDN calls refuse or define, on the
reference backend here and under the Triton interpreter (:func:`interpreter_checks`, in a
fresh process: the variable must be set before triton is imported).

* split API: an input modified in place between forward and backward → ``ValueError``;
* ``T = 0`` / ``B = 0``: the backward gives empty gradients (and ``dh0 = dht``);
* the reference backward's bits do not depend on the strides of ``dht``;
* a cached plan does not let ``cu_seqlens=[0, 3.0, 8]`` through;
* ``check_inputs=True``: ``g > 0``, NaN ``g``, ``beta`` outside ``[0, 1]`` → ``ValueError``;
* ``g = -inf`` is a full reset: finite, the token-by-token recurrence's result;
* a NaN or Inf in one document leaves every other document's bits alone.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from gdn_core import testkit
from gdn_core.containment import check_gdn_containment
from gdn_core.reference import naive_recurrent_gdn
from gdn_core.testkit import make_inputs

OFFS = [0, 5, 70, 90]


def _small(T=10, seed=60):
    inputs, _, _ = make_inputs(B=1, T=T, H=1, HV=2, K=16, V=16, seed=seed)
    return {n: inputs[n] for n in ("q", "k", "v", "g", "beta")}


# ------------------------------------------------------------- split API --


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "initial_state"])
def test_split_bwd_refuses_inputs_modified_in_place(api, name):
    inputs, cu, cot = make_inputs([5, 9], seed=61)
    args = {n: inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state")}
    _, _, saved = api.fwd(**args, cu_seqlens=cu, output_final_state=True)
    api.bwd(saved, cot["do"], cot["dht"])  # unmodified: fine
    args[name].mul_(1.0)  # same values, but written to
    with pytest.raises(ValueError, match=rf"{name} was modified in place after "
                                         rf"{api.fwd.__name__} \(its version counter"):
        api.bwd(saved, cot["do"], cot["dht"])


def test_split_bwd_refuses_modified_gate_parameters(api):
    inputs, cu, cot = make_inputs([7], seed=62, gate=True)
    args = {n: inputs[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    _, _, saved = api.fwd(**args, cu_seqlens=cu, use_gate_in_kernel=True)
    args["A_log"].add_(0.0)
    with pytest.raises(ValueError, match="A_log was modified in place"):
        api.bwd(saved, cot["do"])


# ------------------------------------------------------ empty problems --


@pytest.mark.parametrize("B, T, cu", [(1, 0, None), (0, 5, None), (1, 0, [0, 0, 0])])
def test_empty_problem_backward(api, B, T, cu):
    """No token: the backward gives empty gradients, ``dh0 = dht`` (the state passes
    through), not autograd's "element 0 of tensors does not require grad"."""
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(63)
    shapes = dict(q=(B, T, 1, 16), k=(B, T, 1, 16), v=(B, T, 2, 16), g=(B, T, 2),
                  beta=(B, T, 2), initial_state=(N, 2, 16, 16))
    leaves = {n: torch.randn(s, generator=gen).requires_grad_() for n, s in shapes.items()}
    o, ht = api.autograd(*(leaves[n] for n in ("q", "k", "v", "g", "beta")),
                         initial_state=leaves["initial_state"], output_final_state=True,
                         cu_seqlens=cu)
    assert torch.equal(ht, leaves["initial_state"].detach())
    dht = torch.randn(ht.shape, generator=gen)
    ((o * 1.0).sum() + (ht * dht).sum()).backward()
    for n, x in leaves.items():
        assert x.grad is not None and x.grad.shape == x.shape, n
    assert torch.equal(leaves["initial_state"].grad, dht)
    # the split API too
    _, _, saved = api.fwd(*(leaves[n].detach() for n in ("q", "k", "v", "g", "beta")),
                          initial_state=leaves["initial_state"].detach(),
                          output_final_state=True, cu_seqlens=cu)
    grads = api.bwd(saved, torch.zeros(B, T, 2, 16), dht)
    assert torch.equal(grads.dh0, dht) and grads.dq.shape == (B, T, 1, 16)


# --------------------------------------------------------- stride bits --


def test_final_state_gradient_strides_do_not_change_bits(api):
    """The reference backward reads ``dht`` contiguously: a transposed (or otherwise
    strided) ``dht`` gives the bits of its contiguous copy (``dg`` differed)."""
    gen = torch.Generator().manual_seed(64)
    T, H, HV, K, V = 130, 1, 2, 64, 64
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v, g = torch.randn(1, T, HV, V, generator=gen), -torch.rand(1, T, HV, generator=gen)
    beta, h0 = torch.rand(1, T, HV, generator=gen), torch.randn(1, HV, K, V, generator=gen)
    _, _, saved = api.fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    do = torch.randn(1, T, HV, V, generator=gen)
    strided = torch.randn(1, HV, V, K, generator=gen).transpose(-1, -2)
    a, b = api.bwd(saved, do, strided), api.bwd(saved, do, strided.contiguous())
    for name, x in a.as_dict().items():
        if x is not None:
            assert torch.equal(x, getattr(b, name)), name


def test_float_offsets_never_served_by_a_cached_plan(api):
    args = _small()
    api.autograd(**args, cu_seqlens=[0, 3, 10])  # caches the plan of [0, 3, 10]
    with pytest.raises(TypeError, match=r"cu_seqlens\[1\] is 3.0 \(float\)"):
        api.autograd(**args, cu_seqlens=[0, 3.0, 10])


# ---------------------------------------------------- values: g, beta --


@pytest.mark.parametrize("call", ["autograd", "fwd"])
@pytest.mark.parametrize("name, index, value, pattern", [
    ("g", (0, 3, 1), 0.5, r"g must be <= 0 .* got g\[0, 3, 1\] = 0.5"),
    ("g", (0, 0, 0), float("inf"), r"got g\[0, 0, 0\] = inf"),
    ("g", (0, 9, 0), float("nan"), r"got g\[0, 9, 0\] = nan"),
    ("beta", (0, 2, 1), 1.5, r"beta must lie in \[0, 1\], got beta\[0, 2, 1\] = 1.5"),
    ("beta", (0, 4, 0), -0.25, r"got beta\[0, 4, 0\] = -0.25"),
    ("beta", (0, 4, 0), float("nan"), r"got beta\[0, 4, 0\] = nan"),
])
def test_check_inputs_refuses_values(api, call, name, index, value, pattern):
    args = _small()
    args[name] = args[name].clone()
    args[name][index] = value
    getattr(api, call)(**args)  # unchecked by default: no device sync on the hot path
    with pytest.raises(ValueError, match=pattern):
        getattr(api, call)(**args, check_inputs=True)


def test_check_inputs_accepts_the_domain(api):
    args = _small()
    args["g"] = args["g"].clone()
    args["g"][0, 4] = float("-inf")  # a full reset
    args["beta"] = args["beta"].clone()
    args["beta"][0, 0], args["beta"][0, 1] = 0.0, 1.0
    api.autograd(**args, check_inputs=True)
    api.fwd(**args, check_inputs=True)
    with pytest.raises(TypeError, match="check_inputs must be a bool"):
        api.autograd(**args, check_inputs="yes")


def test_check_inputs_with_the_gate(api):
    """With ``use_gate_in_kernel`` ``g`` is the raw gate input (any real number): only a
    NaN there is refused, and non-finite ``A_log`` / ``dt_bias``."""
    inputs, cu, _ = make_inputs([7], seed=65, gate=True)
    args = {n: inputs[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    args["g"] = args["g"].abs() + 3.0  # positive raw gate input: fine
    api.autograd(**args, cu_seqlens=cu, use_gate_in_kernel=True, check_inputs=True)
    args["dt_bias"] = args["dt_bias"].clone()
    args["dt_bias"][1] = float("nan")
    with pytest.raises(ValueError, match=r"dt_bias must be finite, got dt_bias\[1\] = nan"):
        api.autograd(**args, cu_seqlens=cu, use_gate_in_kernel=True, check_inputs=True)


RESETS = ((3, 0), (20, 1), (20 + 63, 0), (40, 1), (41, 1))  # (token, value head)


def full_reset_case(seed=66):
    """Inputs with ``g = -inf`` at a few tokens (:data:`RESETS`: one at a document start,
    one at a chunk's last token, two in a row) and the oracle's outputs and gradients."""
    inputs, cu, cot = make_inputs([20, 70], H=1, HV=2, seed=seed)
    g = inputs["g"].clone()
    for t, h in RESETS:
        g[0, t, h] = float("-inf")
    inputs["g"] = g
    return inputs, cu, cot


def run_full_reset(fn, inputs, cu, cot):
    return testkit.run_fwd_bwd(fn, inputs, cu, cot, l2norm=True)


def check_full_reset(got: dict, want: dict) -> None:
    for name, x in got.items():
        if x is None:
            continue
        assert torch.isfinite(x).all(), name
        testkit.assert_close({name: x}, {name: want[name]}, rtol=2e-5)
    # nothing depends on g at a reset token: its gradient is exactly zero, as the oracle's
    # (the closed-form dg of the kernels; the old rowsum-minus-colsum form left ~2e-7)
    for t, h in RESETS:
        assert float(got["dg"][0, t, h]) == 0.0 == float(want["dg"][0, t, h]), (t, h)


def test_minus_inf_g_is_a_full_reset(api):
    """``g = -inf`` at token ``t``: ``S_t = k_t β_t v_tᵀ`` (the state is forgotten), as the
    token-by-token recurrence computes it; every output and gradient is finite (``dg`` at
    a reset token included: the recurrence does not depend on it there)."""
    inputs, cu, cot = full_reset_case()
    got = run_full_reset(api.autograd, inputs, cu, cot)
    want = run_full_reset(naive_recurrent_gdn, inputs, cu, cot)
    check_full_reset(got, want)


# ------------------------------------------------------- containment --


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("segment_size", [None, 64])
def test_nonfinite_stays_in_its_document(api, value, segment_size):
    def gdn(q, k, v, g, beta):
        return api.autograd(q, k, v, g, beta, cu_seqlens=OFFS, use_qk_l2norm_in_kernel=True,
                            segment_size=segment_size)[0]

    check_gdn_containment(gdn, OFFS, 1, value)


# ------------------------------------------------------- interpreter --

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, torch
    from gdn_core.containment import check_gdn_containment
    from gdn_core.reference import naive_recurrent_gdn
    from gdn_core.suites import single_rank_fail_closed as S
    api = importlib.import_module(sys.argv[1] + ".ops").API
    out = {}

    def gdn(q, k, v, g, beta):
        return api.autograd(q, k, v, g, beta, cu_seqlens=S.OFFS,
                            use_qk_l2norm_in_kernel=True)[0]

    try:
        check_gdn_containment(gdn, S.OFFS, 1, float("nan"))
        out["contained"] = True
    except AssertionError as e:
        out["contained"] = str(e)
    inputs, cu, cot = S.full_reset_case()
    try:
        S.check_full_reset(S.run_full_reset(api.autograd, inputs, cu, cot),
                           S.run_full_reset(naive_recurrent_gdn, inputs, cu, cot))
        out["reset"] = True
    except AssertionError as e:
        out["reset"] = str(e)
    args = S._small()
    args["beta"] = args["beta"] * 2
    try:
        api.autograd(**args, check_inputs=True)
        out["checked"] = None
    except ValueError as e:
        out["checked"] = str(e)
    for B, T in ((1, 0), (0, 5)):  # the empty problem: the reference backend's results
        x = [torch.randn(s).requires_grad_() for s in
             ((B, T, 1, 16), (B, T, 1, 16), (B, T, 2, 16), (B, T, 2), (B, T, 2), (B, 2, 16, 16))]
        o, ht = api.autograd(*x[:5], initial_state=x[5], output_final_state=True)
        (o.sum() + ht.sum()).backward()
        out[f"empty_{B}_{T}"] = [bool(torch.equal(x[5].grad, torch.ones_like(x[5])))] + [
            list(t.grad.shape) == list(t.shape) for t in x[:5]]
    print(json.dumps(out))
    """
)


def test_fail_closed_on_the_triton_interpreter(api):
    """The kernels: NaN containment per document (forward and backward), ``g = -inf`` as a
    full reset, ``check_inputs``, the empty problem's gradients."""
    (res,) = testkit.run_script(_INTERPRETER_SCRIPT, api.module, timeout=900,
                                TRITON_INTERPRET="1", package=sys.modules[api.module])
    assert res["contained"] is True, res
    assert res["reset"] is True, res
    assert res["checked"] and "beta must lie in [0, 1]" in res["checked"], res
    assert all(res["empty_1_0"]) and all(res["empty_0_5"]), res

