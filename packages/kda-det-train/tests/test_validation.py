"""Mode validation of the saved set and input validation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kda_det_train import (
    KDADetSavedSet,
    chunk_kda_det,
    chunk_kda_det_bwd,
    chunk_kda_det_fwd,
    naive_recurrent_kda,
)


@dataclass
class GDNDetSavedSet:  # a saved set of another mode/package, same-looking fields
    q: torch.Tensor


def _small(make_inputs):
    inputs, cu, cot = make_inputs([10, 70], H=1, HV=2, K=8, V=4, seed=30)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    return args, inputs["initial_state"], cu, cot


@pytest.mark.parametrize(
    "saved",
    [None, object(), {"q": torch.zeros(1)}, (torch.zeros(1),), GDNDetSavedSet(torch.zeros(1))],
    ids=["none", "object", "dict", "tuple", "foreign-saved-set"],
)
def test_bwd_rejects_foreign_saved_set(saved):
    # `do` is not even a tensor: the saved set is checked first, nothing else is touched.
    name = type(saved).__qualname__
    expected = rf"expected a kda_det_train\.KDADetSavedSet.*got .*{name}"
    with pytest.raises(ValueError, match=expected):
        chunk_kda_det_bwd(saved, do="not a tensor")


def test_bwd_rejects_wrong_cotangents(make_inputs):
    args, h0, cu, cot = _small(make_inputs)
    o, ht, saved = chunk_kda_det_fwd(*args, initial_state=h0, output_final_state=True,
                                     cu_seqlens=cu)
    assert isinstance(saved, KDADetSavedSet)
    with pytest.raises(ValueError, match="do must have shape"):
        chunk_kda_det_bwd(saved, cot["do"][:, :-1])
    with pytest.raises(ValueError, match="dht must have shape"):
        chunk_kda_det_bwd(saved, cot["do"], cot["dht"][:1])
    with pytest.raises(TypeError, match="do must be a torch.Tensor"):
        chunk_kda_det_bwd(saved, None)
    with pytest.raises(TypeError, match="floating-point"):
        chunk_kda_det_bwd(saved, cot["do"].long())


def test_bwd_rejects_inputs_modified_in_place(make_inputs):
    args, h0, cu, cot = _small(make_inputs)
    _, _, saved = chunk_kda_det_fwd(*args, initial_state=h0, cu_seqlens=cu)
    args[2].mul_(2)
    with pytest.raises(ValueError, match="modified in place"):
        chunk_kda_det_bwd(saved, cot["do"])


def _bad_cases():
    """(name, mutate(args, kwargs), exception, message regex)."""
    def set_arg(i, fn):
        def mutate(args, kw):
            args[i] = fn(args[i])
        return mutate

    def set_kw(key, fn):
        def mutate(args, kw):
            kw[key] = fn(kw.get(key))
        return mutate

    def hv_not_multiple(args, kw):  # H = 3 q/k heads, HV = 2 value heads
        args[0], args[1] = torch.cat([args[0]] * 3, 2), torch.cat([args[1]] * 3, 2)

    return [
        ("q-not-tensor", set_arg(0, lambda x: x.tolist()), TypeError, "q must be a torch.Tensor"),
        ("q-int", set_arg(0, lambda x: x.long()), TypeError, "q must be a floating-point"),
        ("qkv-dtype-mix", set_arg(2, lambda x: x.double()), TypeError, "share a dtype"),
        ("q-3d", set_arg(0, lambda x: x[0]), ValueError, r"q must be 4-D"),
        ("k-shape", set_arg(1, lambda x: x[..., :4]), ValueError, "q and k must have the same"),
        ("v-T", set_arg(2, lambda x: x[:, :-1]), ValueError, "v must be"),
        ("hv-not-multiple", hv_not_multiple, ValueError, "multiple of the number of q/k heads"),
        ("g-scalar", set_arg(3, lambda x: x[..., 0]), ValueError, "per channel"),
        ("g-trailing", set_arg(3, lambda x: x[..., :4]), ValueError, "g's trailing dim must equal"),
        ("g-heads", set_arg(3, lambda x: x[:, :, :1]), ValueError, "g must be"),
        ("beta-shape", set_arg(4, lambda x: x[..., None]), ValueError, "beta must be 3-D"),
        ("beta-heads", set_arg(4, lambda x: x[..., :1]), ValueError, "beta must be"),
        ("cu-float", set_kw("cu_seqlens", lambda c: c.float()), TypeError, "int32 or int64"),
        ("cu-2d", set_kw("cu_seqlens", lambda c: c[None]), ValueError, "1-D"),
        ("cu-start", set_kw("cu_seqlens", lambda c: c + 1), ValueError, "must start at 0"),
        ("cu-decreasing", set_kw("cu_seqlens", lambda c: torch.tensor([0, 50, 10, 80])),
         ValueError, "non-decreasing"),
        ("cu-end", set_kw("cu_seqlens", lambda c: torch.tensor([0, 10, 79])), ValueError,
         "must end at T = 80"),
        ("cu-list", set_kw("cu_seqlens", lambda c: [0, 10, 80]), TypeError,
         "cu_seqlens must be a torch.Tensor"),
        ("h0-shape", set_kw("initial_state", lambda h: h[:1]), ValueError,
         r"initial_state must be \[N=2"),
        ("h0-int", set_kw("initial_state", lambda h: h.long()), TypeError, "initial_state must be"),
        ("scale-str", set_kw("scale", lambda s: "0.5"), TypeError, "scale must be a float"),
        ("scale-nan", set_kw("scale", lambda s: float("nan")), ValueError, "scale must be finite"),
        ("device", set_arg(4, lambda x: x.to("meta")), ValueError, "beta is on meta"),
    ]


@pytest.mark.parametrize("fn", [chunk_kda_det, chunk_kda_det_fwd, naive_recurrent_kda],
                         ids=["chunk", "fwd", "naive"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case, fn, make_inputs):
    _, mutate, exc, msg = case
    args, h0, cu, _ = _small(make_inputs)
    kw = {"initial_state": h0, "cu_seqlens": cu}
    mutate(args, kw)
    with pytest.raises(exc, match=msg):
        fn(*args, **kw)


def test_cu_seqlens_requires_batch_of_one(make_inputs):
    inputs, _, _ = make_inputs(B=2, T=20, H=1, HV=1, K=8, V=4, initial_state=False)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="B == 1"):
        chunk_kda_det(*args, cu_seqlens=torch.tensor([0, 10, 20]))
