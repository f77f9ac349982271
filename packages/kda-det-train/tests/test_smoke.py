"""Package metadata and the smoke entry points, run in a fresh interpreter."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import gdn_core
import kda_det_train

FORBIDDEN = ("gdn_train", "gdn_det_train", "gdn_train_kcp", "gdn_det_train_kcp")


def test_version_and_smoke_declared():
    assert kda_det_train.__version__ == "0.9.0"
    assert kda_det_train.__smoke__ == ["kda_det_train.smoke:run"]
    for entry in kda_det_train.__smoke__:
        module, func = entry.split(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_smoke_in_fresh_interpreter():
    code = (
        "import sys, importlib, kda_det_train\n"
        "for e in kda_det_train.__smoke__:\n"
        "    m, f = e.split(':'); getattr(importlib.import_module(m), f)()\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "assert not bad, bad\n"
    )
    paths = [str(Path(m.__file__).resolve().parents[1]) for m in (kda_det_train, gdn_core)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
