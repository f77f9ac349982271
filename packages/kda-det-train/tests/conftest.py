"""kda-det-train tests.

* Every test runs under ``torch.use_deterministic_algorithms(True)``.
* ``CUBLAS_WORKSPACE_CONFIG`` is set before CUDA starts (cuBLAS refuses
  deterministic mode without it).
* One intra-op thread: the test shapes are tiny, so threads buy nothing, and
  on a busy 2-core machine OpenMP spinning makes them many times slower.
* In a plain checkout (packages not installed) the sources of this package and
  of gdn-core are put on ``sys.path``; an installed package takes precedence.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.set_num_threads(1)

_PACKAGES = Path(__file__).resolve().parents[2]
for _name, _src in (("gdn_core", "gdn-core/src"), ("kda_det_train", "kda-det-train/src")):
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(_PACKAGES / _src))


@pytest.fixture(autouse=True)
def _deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def _make_inputs(lengths=None, B=1, T=None, H=2, HV=4, K=32, V=16, dtype=torch.float32,
                 g_min=-1.0, seed=0, device="cpu", initial_state=True):
    """Random KDA inputs. ``lengths`` → packed (B == 1) with ``cu_seqlens``."""
    gen = torch.Generator().manual_seed(seed)
    if lengths is not None:
        B, T = 1, sum(lengths)
        offs = [0]
        for n in lengths:
            offs.append(offs[-1] + n)
        cu = torch.tensor(offs, dtype=torch.int32)
        N = len(lengths)
    else:
        cu, N = None, B

    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    inputs = {
        # q, k of norm ≈ 1, as after the L2 norm: the delta rule stays contractive
        "q": randn(B, T, H, K) * K**-0.5,
        "k": randn(B, T, H, K) * K**-0.5,
        "v": randn(B, T, HV, V),
        # per-channel log decay in [g_min, 0]
        "g": (torch.rand(B, T, HV, K, generator=gen) * g_min).to(dtype=dtype, device=device),
        "beta": torch.rand(B, T, HV, generator=gen).to(dtype=dtype, device=device),
        "initial_state": randn(N, HV, K, V).to(state_dtype) if initial_state else None,
    }
    cotangents = {
        "do": randn(B, T, HV, V),
        "dht": randn(N, HV, K, V).to(state_dtype),
    }
    return inputs, cu, cotangents


@pytest.fixture
def make_inputs():
    return _make_inputs


_GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _run(fn, inputs, cu, cot, *, l2norm=False, output_final_state=True, scale=None):
    """Forward + backward of ``fn``; returns a dict of outputs and input gradients."""
    leaves = {n: (x.detach().clone().requires_grad_() if x is not None else None)
              for n, x in inputs.items()}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=scale,
               initial_state=leaves["initial_state"], output_final_state=output_final_state,
               cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm)
    loss = (o.float() * cot["do"].float()).sum()
    if ht is not None:
        loss = loss + (ht * cot["dht"].to(ht.dtype)).sum()
    loss.backward()
    out = {"o": o.detach(), "ht": None if ht is None else ht.detach()}
    for n in _GRAD_NAMES:
        out["d" + n] = None if leaves[n] is None else leaves[n].grad
    return out


@pytest.fixture
def run_fwd_bwd():
    return _run


_DIGEST_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from kda_det_train import chunk_kda_det

    device = sys.argv[1]
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(1234)
    lengths = [1, 63, 64, 65, 200]
    T, H, HV, K, V = sum(lengths), 2, 4, 32, 16
    cu = torch.tensor([0, 1, 64, 128, 193, 393])
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, T, H, K).to(device, dt).requires_grad_()
    k = torch.randn(1, T, H, K).to(device, dt).requires_grad_()
    v = torch.randn(1, T, HV, V).to(device, dt).requires_grad_()
    g = (-5 * torch.rand(1, T, HV, K)).to(device).requires_grad_()
    beta = torch.rand(1, T, HV).to(device, dt).requires_grad_()
    h0 = torch.randn(len(lengths), HV, K, V).to(device).requires_grad_()
    o, ht = chunk_kda_det(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    do, dht = torch.randn(o.shape).to(o), torch.randn(ht.shape).to(ht)
    ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
    named = dict(o=o, ht=ht, dq=q.grad, dk=k.grad, dv=v.grad, dg=g.grad, dbeta=beta.grad,
                 dh0=h0.grad)
    digest = {n: hashlib.sha256(x.detach().float().cpu().numpy().tobytes()).hexdigest()
              for n, x in named.items()}
    json.dump(digest, sys.stdout)
    """
)


def _process_digests(device: str, processes: int = 2) -> list[dict]:
    """sha256 of every output and gradient of a fixed problem, one dict per fresh process.

    The processes run concurrently; each seeds the same generator.
    """
    import gdn_core
    import kda_det_train

    paths = [str(Path(m.__file__).resolve().parents[1]) for m in (kda_det_train, gdn_core)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen([sys.executable, "-c", _DIGEST_SCRIPT, device], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    digests = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        digests.append(json.loads(out))
    return digests


@pytest.fixture
def process_digests():
    return _process_digests
