"""On a GPU (``pytest -m gpu``): gdn_det_train.use_in_transformers in bf16 against the model's own
path, and the packed ``cu_seq_lens_q`` path. Run it where fla is not installed: with fla,
transformers' own path is fla's kernel."""

from __future__ import annotations

import pytest
import torch
from gdn_core.transformers_testing import diff_packed_layer, train_side_by_side

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("transformers")

import gdn_det_train  # noqa: E402


@pytest.fixture(autouse=True)
def _warn_only():
    """transformers' own ops (its MoE's index_add_ on CUDA) may lack a deterministic
    implementation: warn instead of raising, for this comparison only."""
    was, warn = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn)


def test_bf16_switched_model_trains_like_its_own_path():
    report = train_side_by_side(gdn_det_train.use_in_transformers, steps=3, shape=(2, 256),
                                device="cuda", dtype=torch.bfloat16)
    for step in report:
        assert step["missing"] == []
        assert step["loss_diff"] < 2e-2 * step["loss"], step["loss_diff"]
        assert max(step["grad_rel"].values()) < 5e-2, step["grad_rel"]


def test_bf16_packed_documents_through_cu_seq_lens_q():
    diff = diff_packed_layer(gdn_det_train.use_in_transformers, lengths=(100, 7, 300, 64),
                             device="cuda", dtype=torch.bfloat16)
    assert diff < 2e-2, diff
