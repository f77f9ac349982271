"""gdn_det_train.use_in_transformers: a tiny random transformers Qwen3-Next model on our kernels
against its own torch path (3 AdamW steps: loss and every gradient, kernel calls counted),
packed documents, restore, the kernel's strict signature (gdn_core.transformers_testing).

Skipped when transformers is not installed (`pip install gdn-det-train[transformers]`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import gdn_det_train  # noqa: E402
from gdn_core.transformers_testing import SwitchChecks  # noqa: E402
from gdn_det_train import integrations  # noqa: E402


class TestUseInTransformers(SwitchChecks):
    package, integrations = gdn_det_train, integrations
    kernel, conv = "chunk_gated_delta_rule_det", "causal_conv1d_det"
