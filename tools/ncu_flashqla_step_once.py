"""One warm forward+backward each of FlashQLA's ``chunk_gated_delta_rule`` and of
``gdn_det_train``'s at B1 T32768 H16 in the benchmark's 8 documents (bf16, K = V = 128,
``g`` fp32, FlashQLA with ``auto_cp=False``: its exact path, as ours is), between
``cudaProfilerStart``/``Stop``: the target of ``ncu --profile-from-start off`` in
``tools/h200_s27_validate.sh 2`` (FlashQLA's fused backward beside our backward kernels:
issue rate, warps a CTA, stall mix). GPU only; ``flash_qla`` on the path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import common  # noqa: E402
import torch  # noqa: E402
from flash_qla import chunk_gated_delta_rule as qla  # noqa: E402
from gdn_det_train import chunk_gated_delta_rule_det as det  # noqa: E402

x = common.make_gdn_inputs(common.GDNShape(B=1, T=32768, H=16, D=8), device="cuda")
leaves = [x.q, x.k, x.v, x.g, x.beta]


def step(fn, **kw):
    for t in leaves:
        t.grad = None
    o = fn(*leaves, cu_seqlens=x.cu_seqlens, **kw)[0]
    o.backward(x.do)


for _ in range(2):
    step(qla, auto_cp=False)
    step(det)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
step(qla, auto_cp=False)
step(det)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("ok")
