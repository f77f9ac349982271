"""The API reference builds from the docstrings (``tools/api_docs.py``: ``hatch run api-docs``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["gdn_core", "gdn_train", "gdn_det_train", "gdn_train_kcp", "gdn_det_train_kcp",
            "kda_det_train"]


def test_pdoc_builds_a_page_per_package_with_the_layers(tmp_path):
    pytest.importorskip("pdoc")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "api_docs.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in PACKAGES:
        assert (tmp_path / f"{name}.html").is_file(), name
    assert "SingleRankGatedDeltaNet" in (tmp_path / "gdn_core" / "layers.html").read_text()
    pages = (("gdn_det_train", "GatedDeltaNet"), ("gdn_det_train_kcp", "GatedDeltaNetKCP"))
    for name, cls in pages:
        assert cls in (tmp_path / f"{name}.html").read_text(), name
