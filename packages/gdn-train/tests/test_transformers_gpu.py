"""On a GPU (``pytest -m gpu``): gdn_train.use_in_transformers in bf16 against the model's own
path, and the packed ``cu_seq_lens_q`` path (gdn_core.transformers_testing). Run it where
fla is not installed: with fla, transformers' own path is fla's kernel."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import gdn_train  # noqa: E402
from gdn_core.transformers_testing import SwitchChecksGPU  # noqa: E402


class TestUseInTransformersGPU(SwitchChecksGPU):
    package = gdn_train
