"""On a GPU (``pytest -m gpu -s``: prints the figures): gdn_det_train.use_in_transformers in bf16
against transformers' own torch path (pinned, whatever is installed): losses over 3 steps,
every parameter group's gradient error against the fp32 torch path beside the own bf16 path's,
and the packed ``cu_seq_lens_q`` path (gdn_core.transformers_testing)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import gdn_det_train  # noqa: E402
from gdn_core.transformers_testing import SwitchChecksGPU  # noqa: E402


class TestUseInTransformersGPU(SwitchChecksGPU):
    package = gdn_det_train
