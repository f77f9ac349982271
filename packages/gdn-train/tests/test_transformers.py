"""gdn_train.use_in_transformers: a tiny random transformers Qwen3-Next model on our kernels
against its own torch path (3 AdamW steps), packed documents, the kernel's strict signature.

Skipped when transformers is not installed (`pip install gdn-train[transformers]`).
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.transformers_testing import diff_packed_layer, train_side_by_side

pytest.importorskip("transformers")

import gdn_train  # noqa: E402
from gdn_train import integrations  # noqa: E402

KERNEL, CONV = "chunk_gated_delta_rule", "causal_conv1d"


@pytest.fixture
def calls(monkeypatch):
    """Counts the package kernel's and conv's calls made through the switch."""
    counts = {"gdn": 0, "conv": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name, attr in (("gdn", KERNEL), ("conv", CONV)):
        monkeypatch.setattr(integrations, attr, counted(name, getattr(integrations, attr)))
    return counts


def test_switched_model_trains_like_its_torch_path(calls):
    report = train_side_by_side(gdn_train.use_in_transformers, steps=3)
    assert report[0]["switched"] == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    # 2 GDN layers x 3 steps (forward; the backward is the kernel's own)
    assert calls == {"gdn": 6, "conv": 6}
    n_params = len(report[0]["grad_diff"])
    assert n_params > 20
    for step in report:
        assert step["missing"] == [] and len(step["grad_diff"]) == n_params
        assert step["loss_diff"] < 1e-5, step["loss_diff"]
        assert max(step["grad_diff"].values()) < 2e-5, step["grad_diff"]


def test_packed_documents_through_cu_seq_lens_q(calls):
    assert diff_packed_layer(gdn_train.use_in_transformers) < 1e-5
    assert calls == {"gdn": 1, "conv": 1}


def test_restore_gives_the_model_back_its_own_path(calls):
    from gdn_core.transformers_testing import tiny_qwen3_next_model

    model = tiny_qwen3_next_model()
    ids = torch.randint(0, 64, (1, 16))
    gdn_train.use_in_transformers(model)
    assert gdn_train.restore_transformers(model) == ["model.layers.0.linear_attn",
                                                "model.layers.2.linear_attn"]
    model(input_ids=ids)
    assert calls == {"gdn": 0, "conv": 0}


def test_the_kernel_itself_stays_strict():
    q = torch.randn(1, 8, 1, 16)
    with pytest.raises(TypeError, match="use_cache"):
        getattr(gdn_train, KERNEL)(q, q, q, -torch.rand(1, 8, 1), torch.rand(1, 8, 1),
                            use_cache=False)


def test_a_model_without_gdn_layers_is_refused():
    with pytest.raises(ValueError, match="GDN"):
        gdn_train.use_in_transformers(torch.nn.Linear(2, 2))
