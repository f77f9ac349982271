"""One warm launch each of the fused backward (two-role kernel) and of the pair it replaces
(fused state backward + one-tile chunk gradients) at T32768 in 8 segments, between
``cudaProfilerStart``/``Stop``: the target of ``ncu --profile-from-start off`` in
``tools/h200_s25_validate.sh 4`` (per-instruction stall samples). GPU only."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from gluon_fused_bwd_probe import _arms, _problem  # noqa: E402

arms = _arms(_problem(32768, 8, False))
for fn in (arms["fused"], arms["pair"]):
    fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
arms["fused"]()
arms["pair"]()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("ok")
