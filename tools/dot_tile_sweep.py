"""Which K/V block sizes Triton 3.6 gets right on Hopper: run gdn-core's GPU
backward tests under alternative kernel configurations, each in its own process
(an illegal address ends the process's CUDA context).

    python tools/dot_tile_sweep.py [--jobs 6]

Each variant patches ``gdn_core.ops.tiles.MIN_DOT_TILE`` and/or one kernel's
pinned configuration before pytest runs the selected tests ("head": the code as it
is); it prints one line per variant and selection: passed / failed with the first
assertion or CUDA error. Needs CUDA. The figures behind ``gdn_core.ops.tiles``:
``benchmarks/results/2026-11-30-h200-s4-tiles.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = "packages/gdn-core/tests/test_ops_backward.py"
SELECT = {  # test selections (pytest -k) the variants run
    "K256-bf16": "test_full_backward_gpu and group4 and bf16",
    "small-heads": "test_full_backward and not gpu",
    "gpu-cases-bf16": "test_full_backward_gpu and bf16",
}


def _state_bwd(BV: int, warps: int) -> str:
    return ("import gdn_core.ops.chunk_state_bwd as m; f = m.chunk_state_bwd_config\n"
            f"m.chunk_state_bwd_config = lambda K, V, e=2: {{**f(K, V, e), "
            f"**({{'BV': {BV}, 'num_warps': {warps}}} if K > 128 else {{}})}}\n")


VARIANTS = {  # name -> (patch source, selections)
    "head": ("", ["K256-bf16", "small-heads", "gpu-cases-bf16"]),
    "floor32": ("import gdn_core.ops.tiles as t; t.MIN_DOT_TILE = 32\n", ["small-heads"]),
    "state_bwd-K256-BV32-w8": (_state_bwd(32, 8), ["K256-bf16"]),
}


def _run(name: str, patch: str, select: str) -> str:
    argv = ["-q", "-x", "-p", "no:cacheprovider", "--import-mode=importlib", TESTS,
            "-k", SELECT[select]]
    code = patch + f"import sys, pytest\nsys.exit(pytest.main({argv!r}))\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=400)
    lines = proc.stdout.splitlines()
    summary = next((x for x in reversed(lines) if " in " in x and ("passed" in x or "failed" in x)),
                   lines[-1] if lines else proc.stderr[-200:])
    first = next((x.strip() for x in lines if x.startswith("E ")), "")
    return f"{name:28s} {select:15s} rc={proc.returncode}  {summary.strip()}  {first}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=6)
    args = parser.parse_args()
    jobs = [(n, p, s) for n, (p, sels) in VARIANTS.items() for s in sels]
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda j: _run(*j), jobs):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
