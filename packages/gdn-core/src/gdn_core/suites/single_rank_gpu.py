"""On the GPU (``pytest -m gpu``): bf16 CUDA kernels against the fp32 oracle, and
repeat runs through one workspace.

What a repeat must give depends on the package's mode: the deterministic package
promises the same bits (10 runs, and the conv's second CUDA run), the other one
agreement within bf16 tolerance (4 runs). Run on a single-rank package through its
``api`` fixture.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gdn_core.suites.gpu_marks import ONE_GPU
from gdn_core.testkit import make_inputs, reference_gdn, rel_err, run_fwd_bwd

pytestmark = ONE_GPU

LENGTHS = [1, 63, 64, 65, 500, 1100]


def _cuda(inputs: dict, cu: Any, cot: dict, dtype: torch.dtype) -> tuple[dict, Any, dict]:
    """Move to CUDA; q, k, v, beta in ``dtype``, the rest fp32."""
    low = {"q", "k", "v", "beta", "do"}

    def mv(name, x):
        if x is None:
            return None
        return x.to("cuda", dtype if name in low else torch.float32)

    inputs = {n: mv(n, x) for n, x in inputs.items()}
    cot = {n: mv(n, x) for n, x in cot.items()}
    return inputs, (cu.cuda() if isinstance(cu, torch.Tensor) else cu), cot


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
def test_bf16_against_fp32_reference(api, gate, l2norm, heads):
    H, HV = heads
    inputs, cu, cot = make_inputs(LENGTHS, H=H, HV=HV, K=128, V=128, seed=60, gate=gate)
    inputs, cu, cot = _cuda(inputs, cu, cot, torch.bfloat16)
    got = run_fwd_bwd(api.autograd, inputs, cu, cot, l2norm=l2norm)
    # the oracle sees the same (bf16-rounded) inputs, in fp32
    ref_inputs = {n: (x.float() if x is not None else None) for n, x in inputs.items()}
    ref = run_fwd_bwd(reference_gdn, ref_inputs, cu, cot, l2norm=l2norm)
    errors = {n: rel_err(got[n], ref[n]) for n in ref if ref[n] is not None}
    assert all(e <= 1e-2 for e in errors.values()), errors


def test_workspace_reuse_repeats(api):
    """Deterministic: 10 runs, the same bits; otherwise 4 runs within 1e-2."""
    inputs, cu, cot = make_inputs(LENGTHS, H=2, HV=4, K=128, V=128, seed=61, gate=True)
    inputs, cu, cot = _cuda(inputs, cu, cot, torch.bfloat16)
    ws = api.workspace_cls.for_inputs(inputs["q"], inputs["v"], cu)
    first = run_fwd_bwd(api.autograd, inputs, cu, cot, l2norm=True, workspace=ws)
    for _ in range(9 if api.deterministic else 3):
        again = run_fwd_bwd(api.autograd, inputs, cu, cot, l2norm=True, workspace=ws)
        for name, a in first.items():
            if a is not None:
                if api.deterministic:
                    assert torch.equal(a, again[name]), name
                else:
                    assert rel_err(again[name], a) < 1e-2, name


def test_conv1d_cuda_matches_cpu(api):
    """Deterministic: a second CUDA run also gives the first one's bits."""
    gen = torch.Generator().manual_seed(62)
    x = torch.randn(1, 5000, 256, generator=gen)
    w = torch.randn(256, 4, generator=gen)
    b = torch.randn(256, generator=gen)
    dy = torch.randn(1, 5000, 256, generator=gen)
    cu = [0, 1, 2000, 5000]

    def run(device):
        xs, ws, bs = (t.to(device).clone().requires_grad_() for t in (x, w, b))
        y = api.conv(xs, ws, bs, "silu", cu)
        (y * dy.to(device)).sum().backward()
        return [t.detach().cpu() for t in (y, xs.grad, ws.grad, bs.grad)]

    cpu, gpu = run("cpu"), run("cuda")
    for a, c in zip(cpu, gpu):
        assert rel_err(c, a) < 1e-5
    if api.deterministic:
        for c, d in zip(gpu, run("cuda")):
            assert torch.equal(c, d)
