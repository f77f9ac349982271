"""One warm launch each of the one-tile Gluon chunk-gradient kernel and of the persistent
(next-tile-prefetching) one at B1 T32768 H16 in 8 documents, between
``cudaProfilerStart``/``Stop``: the target of ``ncu --profile-from-start off`` in
``tools/h200_s26_validate.sh 7`` (why the persistent kernel is slower). GPU only."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_variants  # noqa: E402
import torch  # noqa: E402
from gdn_core.ops.gluon.chunk_grads import chunk_grads_bwd_gluon  # noqa: E402
from gdn_core.ops.gluon.chunk_grads_pipelined import (  # noqa: E402
    chunk_grads_bwd_gluon_pipelined,
)

p = kernel_variants._problem(32768, 8, "cuda")
call = (p["q"], p["k"], p["v"], p["v_new"], p["h"], p["dh"], p["do"], p["dvp"], p["G"],
        p["beta"], p["A_inv"], p["scale"], p["index"], 1, p["g_dtype"])


def run(fn):
    return fn(*call, dq=torch.empty_like(call[0]), dk=torch.empty_like(call[1]))


for fn in (chunk_grads_bwd_gluon, chunk_grads_bwd_gluon_pipelined):
    run(fn)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
run(chunk_grads_bwd_gluon)
run(chunk_grads_bwd_gluon_pipelined)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("ok")
