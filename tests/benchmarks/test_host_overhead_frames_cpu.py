"""Issue 18's host-path targets, held: ``benchmarks/host_overhead_frames.py`` on the CPU.

For both single-rank packages (one document, T=128, the Triton interpreter): at most
5 project frames from each public function to its first kernel launch, forward and
backward, for the autograd call and the split API; at most 150 project Python calls
per forward+backward; the autograd call's eager forward does not go through the custom
op (its first launch is reached through ``ChunkGDNFunction``, not ``torch.ops``).
The script sets ``TRITON_INTERPRET`` at import, so it runs in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "host_overhead_frames.py"


def test_frames_and_calls_within_the_targets(tmp_path):
    out = tmp_path / "frames.json"
    env = {k: v for k, v in os.environ.items() if k != "GDN_CORE_BACKEND"}
    subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], check=True, env=env,
                   cwd=REPO_ROOT, timeout=600, capture_output=True)
    results = json.loads(out.read_text())
    assert [r["package"] for r in results] == ["gdn_det_train", "gdn_train"]
    for r in results:
        for key in ("autograd", "split"):
            fwd, bwd = r[f"{key}_fwd"], r[f"{key}_bwd"]
            assert 1 <= len(fwd["stack"]) <= 5, (r["package"], key, fwd["stack"])
            assert 1 <= len(bwd["stack"]) <= 5, (r["package"], key, bwd["stack"])
            assert fwd["calls"] + bwd["calls"] <= 150, (r["package"], key)
            assert fwd["launches"] + bwd["launches"] == 10, (r["package"], key)
        assert any(s.endswith("autograd.py:forward") for s in r["autograd_fwd"]["stack"]), \
            r["autograd_fwd"]["stack"]
        assert not any("train_ops.py" in s for s in r["autograd_fwd"]["stack"]), \
            r["autograd_fwd"]["stack"]
