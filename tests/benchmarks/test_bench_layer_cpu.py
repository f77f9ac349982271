"""CPU smoke test of benchmarks/bench_layer.py: a tiny layer, our two arms, the check
table and one timing row per shape."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "bench_layer.py"


def test_smoke_run_reports_check_and_timing(tmp_path):
    out = tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--dtype", "float32", "--hidden", "32",
         "--heads", "2:4:16", "--shape", "1:80:2", "--shape", "2:40", "--warmup", "0",
         "--rep", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    checks = re.findall(r"^\| (det|fast) \| (\S+) \| (\S+) \| (\S+) \((\d+)\) \|$", report, re.M)
    assert [c[0] for c in checks] == ["det", "fast"]
    for _, *errs, n in checks:
        assert int(n) == 13 and all(float(e) < 1e-5 for e in errs), checks
    rows = re.findall(r"^\| (1, 80, 2|2, 40, 1) \| .* \|$", report, re.M)
    assert rows == ["1, 80, 2", "2, 40, 1"]
