"""CPU smoke test of benchmarks/bench_conv.py: our kernels under the interpreter and the
torch path on a tiny packed input, the check table and the timing table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "bench_conv.py"


def test_smoke_run_reports_check_and_timing():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("GDN_CORE_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--dtype", "float32", "--T", "40",
         "--D", "6", "--docs", "3"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    checks = re.findall(r"^\| (ours|torch) \| (\S+) \| (\S+) \| (\S+) \|$", proc.stdout, re.M)
    assert [c[0] for c in checks] == ["ours", "torch"], proc.stdout
    assert all(float(e) < 1e-5 for c in checks for e in c[1:]), checks
    assert "bitwise repeatable (y, dx, dweight): True" in proc.stdout
    rows = re.findall(r"^\| (ours|torch) \| [\d.]+ \| \d+ \| [\d.]+ \| \d+ \|$", proc.stdout,
                      re.M)
    assert rows == ["ours", "torch"], proc.stdout
