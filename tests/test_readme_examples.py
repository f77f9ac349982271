"""The README's "Use it in your model" examples run as written.

Each ```python block of the root README runs in a fresh interpreter (the one
needing transformers is skipped without it), and the context-parallel example
runs under ``torchrun`` with 2 gloo ranks, as the README says (watched: its process
group must be gone when it destroys it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "GDN_CORE_BACKEND", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, as CI has it
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{args}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def test_the_readme_has_its_examples():
    assert len(BLOCKS) == 2
    assert "torchrun --nproc_per_node 2 docs/examples/kcp_layer.py" in \
        (ROOT / "README.md").read_text()


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(index):
    code = BLOCKS[index]
    if "transformers" in code and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    out = _run([sys.executable, "-c", code]).stdout
    if "use_in_transformers" in code:
        assert "['model.layers.0.linear_attn']" in out
    else:
        assert "torch.Size([1, 300, 64]) torch.Size([2, 4, 16, 16])" in out


def test_context_parallel_example_under_torchrun():
    """The example as written, watched: when it calls ``destroy_process_group()`` (its
    context, output and graph still alive, as at the end of any script), no rank's group
    may survive — one that does is torn down in interpreter finalisation, where gloo can
    abort the rank (``tests/workers/watch_group_release.py``)."""
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "tests/workers/watch_group_release.py", "docs/examples/kcp_layer.py"]).stdout
    assert re.search(r"2 ranks, .*max \|out - single rank\| = \S+", out), out
    assert sorted(re.findall(r"rank (\d): group (\w+) after destroy_process_group", out)) == \
        [("0", "released"), ("1", "released")], out
