"""benchmarks/host_overhead_gpu.py counts synchronisations, not the sync debug mode's notice.

The first ``torch.cuda.set_sync_debug_mode`` call of a process emits a one-time
``UserWarning`` ("Synchronization debug mode is a prototype feature and does not yet
detect all synchronizing operations", a ``TORCH_WARN_ONCE``). The script counted every
warning naming a synchronisation, so whichever implementation it measured first showed
one sync per call (session 7 on the H200: ``gdn_det_train`` 1, ``gdn_train`` 0, for
calls running the same code). Here ``torch.cuda`` is replaced by a stand-in that
behaves as PyTorch's does (the notice once, then a real detection only where a step
synchronises), so the count is checked without a GPU; then the CPU run of the script.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "host_overhead_gpu.py"
NOTICE = ("Synchronization debug mode is a prototype feature and does not yet detect all "
          "synchronizing operations")
DETECTION = "called a synchronizing CUDA operation"


@pytest.fixture()
def bench():
    spec = importlib.util.spec_from_file_location("host_overhead_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _FakeCuda:
    """``torch.cuda``'s sync debug mode as PyTorch implements it, without a GPU."""

    def __init__(self) -> None:
        self.mode, self.noticed = 0, False

    def set_sync_debug_mode(self, mode) -> None:
        if not self.noticed:  # TORCH_WARN_ONCE in THCPModule_cudaSetSyncDebugMode
            self.noticed = True
            warnings.warn(NOTICE, UserWarning, stacklevel=2)
        self.mode = {"default": 0, "warn": 1, "error": 2}[mode]

    def synchronize(self) -> None:
        if self.mode == 1:
            warnings.warn(DETECTION, UserWarning, stacklevel=2)

    def item(self) -> None:  # a step's device->host read
        self.synchronize()


def test_the_first_implementation_measured_shows_no_phantom_sync(bench, monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(bench.torch, "cuda", fake)
    # two implementations that never synchronise, in the order the script times them
    assert bench._sync_warnings(lambda: None, cuda=True) == 0
    assert bench._sync_warnings(lambda: None, cuda=True) == 0
    seen: list[str] = []
    assert bench._sync_warnings(fake.item, cuda=True, seen=seen) == 1  # a real one counts
    assert seen == [DETECTION]


def test_sync_detections_keeps_every_detection_but_the_notice(bench):
    msgs = [NOTICE, DETECTION, "something else", "a synchronization of another kind"]
    assert bench.sync_detections(msgs) == [DETECTION, "a synchronization of another kind"]
    assert bench._sync_warnings(lambda: None, cuda=False) is None


def test_cpu_run_of_the_script():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("GDN_CORE_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--dtype", "float32", "--shape",
         "1,64,1,16,16", "--iters", "1", "--warmup", "1", "--repeats", "1", "--no-fla",
         "--order", "gdn_train,gdn_det_train"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = [line.split()[0] for line in proc.stdout.splitlines() if " host " in line]
    assert names == ["gdn_train", "gdn_det_train"], proc.stdout
