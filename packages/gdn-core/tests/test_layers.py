"""The shared GDN layer (gdn_core.layers): against transformers' Qwen3-Next layer, packed
documents against separate ones, the state-dict converters, fla's parameter names.

Without a GPU the kernels run under Triton's interpreter here (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.layers import (
    SingleRankGatedDeltaNet,
    from_qwen3_next_state_dict,
    to_qwen3_next_state_dict,
)
from gdn_core.layers.testing import (
    TINY,
    diff_packed_vs_separate,
    diff_vs_qwen3_next,
    tiny_layer,
    tiny_qwen3_next_layer,
)

DIMS = dict(num_k_heads=TINY["num_heads"], num_v_heads=TINY["num_v_heads"],
            head_k_dim=TINY["head_dim"], head_v_dim=TINY["head_dim"])


def test_matches_transformers_qwen3_next_layer_and_every_gradient():
    pytest.importorskip("transformers")
    diffs = diff_vs_qwen3_next(SingleRankGatedDeltaNet, seed=3)
    assert {"out", "dx", "in_proj_qkvz.weight", "conv1d.weight", "A_log", "dt_bias",
            "norm.weight", "out_proj.weight", "in_proj_ba.weight"} <= diffs.keys()
    assert max(diffs.values()) < 2e-4, diffs


def test_qwen3_next_conversion_round_trips_bitwise():
    pytest.importorskip("transformers")
    sd = tiny_qwen3_next_layer(seed=1).state_dict()
    back = to_qwen3_next_state_dict(from_qwen3_next_state_dict(sd, **DIMS), **DIMS)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[n], sd[n]) for n in sd)


def test_conversion_rejects_a_conv_bias_qwen3_next_cannot_hold():
    layer = SingleRankGatedDeltaNet(**TINY, conv_bias=True)
    with pytest.raises(ValueError, match="bias"):
        to_qwen3_next_state_dict(layer.state_dict(), **DIMS)


@pytest.mark.parametrize("options, lengths", [({}, [30, 5, 66]),
                                              ({"conv_bias": True, "use_gate": False}, [17, 9])])
def test_packed_documents_equal_documents_run_alone(options, lengths):
    layer = tiny_layer(SingleRankGatedDeltaNet, seed=2, **options)
    diffs = diff_packed_vs_separate(layer, lengths)
    assert max(diffs.values()) < 1e-5, diffs


def test_initial_state_changes_the_output():
    layer = tiny_layer(SingleRankGatedDeltaNet, seed=4)
    x = torch.randn(1, 20, TINY["hidden_size"])
    h0 = torch.randn(1, TINY["num_v_heads"], TINY["head_dim"], TINY["head_dim"])
    with torch.no_grad():
        zero, _ = layer(x)
        given, _ = layer(x, initial_state=h0)
    assert (zero - given).abs().max() > 1e-3


def test_state_dict_names_and_shapes_are_fla_gated_deltanet_s():
    fla_layers = pytest.importorskip("fla.layers")
    kw = dict(hidden_size=48, head_dim=16, num_heads=2, num_v_heads=4, expand_v=2.0,
              conv_size=4)
    theirs = fla_layers.GatedDeltaNet(**kw).state_dict()
    ours = SingleRankGatedDeltaNet(**kw).state_dict()
    assert {n: tuple(t.shape) for n, t in ours.items()} == \
        {n: tuple(t.shape) for n, t in theirs.items()}


def test_rejects_value_heads_that_do_not_group():
    with pytest.raises(ValueError, match="multiple"):
        SingleRankGatedDeltaNet(hidden_size=32, num_heads=2, num_v_heads=3, head_dim=16)
