"""Bad input is refused from the public API, naming the public argument."""

from __future__ import annotations

import pytest
import torch

from gdn_core.testkit import make_inputs


def _base():
    inputs, _, _ = make_inputs(B=1, T=10, H=1, HV=2, K=16, V=16, seed=50)
    return dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], g=inputs["g"], beta=inputs["beta"])


@pytest.mark.parametrize("call", ["autograd", "fwd"])
@pytest.mark.parametrize(
    "change, exc, pattern",
    [
        (dict(q=torch.zeros(1, 10, 16)), ValueError, r"q must be \[B, T, H, K\]"),
        (dict(k=torch.zeros(1, 10, 1, 32)), ValueError, "k must have q's shape"),
        (dict(q=torch.zeros(1, 10, 3, 16), k=torch.zeros(1, 10, 3, 16)), ValueError,
         r"HV=2 \(v.shape\[2\]\) must be a positive multiple of the q/k heads H=3"),
        (dict(g=torch.zeros(1, 10, 3)), ValueError, "g must have shape"),
        (dict(beta=torch.zeros(1, 9, 2)), ValueError, "beta must have shape"),
        (dict(q=torch.zeros(1, 10, 1, 16, dtype=torch.int32)), TypeError, "q has dtype"),
        (dict(v="v"), TypeError, "v must be a torch.Tensor"),
        (dict(cu_seqlens=[0, 4, 9]), ValueError, "cu_seqlens must end at T=10"),
        (dict(cu_seqlens=torch.tensor([0.0, 10.0])), TypeError, "cu_seqlens has dtype"),
        (dict(cu_seqlens=[0, 3.7, 10]), TypeError, r"cu_seqlens\[1\] is 3.7 \(float\)"),
        (dict(cu_seqlens=[0, 3.0, 10]), TypeError, r"cu_seqlens\[1\] is 3.0 \(float\)"),
        (dict(cu_seqlens=torch.tensor([0, 10], device="meta")), ValueError,
         "cu_seqlens is on meta; expected the CPU or the inputs' device cpu"),
        (dict(initial_state=torch.zeros(2, 2, 16, 16)), ValueError, "initial_state must have"),
        (dict(scale=float("nan")), ValueError, "scale must be a finite float"),
        (dict(scale=True), TypeError, "scale must be a float or None, got bool"),
        (dict(scale="0.5"), TypeError, "scale must be a float or None, got str"),
        (dict(output_final_state="no"), TypeError, "output_final_state must be a bool"),
        (dict(use_qk_l2norm_in_kernel="no"), TypeError, "use_qk_l2norm_in_kernel must be a bool"),
        (dict(v=torch.zeros(1, 10, 0, 16), g=torch.zeros(1, 10, 0), beta=torch.zeros(1, 10, 0)),
         ValueError, r"HV=0 \(v.shape\[2\]\) must be a positive multiple"),
    ],
)
def test_bad_inputs(api, call, change, exc, pattern):
    args = _base()
    args.update(change)
    with pytest.raises(exc, match=pattern):
        getattr(api, call)(**args)


def test_head_dim_not_multiple_of_16(api):
    args = _base()
    args.update(q=torch.zeros(1, 10, 1, 24), k=torch.zeros(1, 10, 1, 24))
    with pytest.raises(ValueError, match="head dimension K"):
        api.autograd(**args)


def test_bwd_bad_gradients(api):
    args = _base()
    _, _, saved = api.fwd(**args)
    with pytest.raises(ValueError, match="do must have shape"):
        api.bwd(saved, torch.zeros(1, 10, 2, 8))
    with pytest.raises(ValueError, match="dht must have shape"):
        api.bwd(saved, torch.zeros(1, 10, 2, 16), torch.zeros(2, 2, 16, 16))
    with pytest.raises(TypeError, match="do must be a torch.Tensor"):
        api.bwd(saved, None)
