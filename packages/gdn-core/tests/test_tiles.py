"""Every kernel's pinned configuration keeps its K/V blocks off the widths Triton 3.6
gets wrong on Hopper (16 anywhere; 32 beside a 256-row state tile), and covers the
state's K extent in one tile where the kernel needs that."""

from __future__ import annotations

import pytest
from gdn_core.ops.chunk_grads_bwd import chunk_grads_config
from gdn_core.ops.chunk_state import chunk_state_config
from gdn_core.ops.chunk_state_bwd import chunk_state_bwd_config
from gdn_core.ops.dv_local import dv_local_config
from gdn_core.ops.output import chunk_output_config
from gdn_core.ops.tiles import MIN_DOT_TILE, dot_tile
from gdn_core.ops.wy import wy_config

CONFIGS = [chunk_state_config, chunk_state_bwd_config, chunk_grads_config, dv_local_config,
           chunk_output_config, wy_config]
WHOLE_K = {chunk_state_config, chunk_state_bwd_config}  # the state's rows live in one tile


def test_dot_tile():
    assert MIN_DOT_TILE == 64
    got = [dot_tile(n, 256) for n in (1, 16, 17, 32, 48, 64, 100, 256)]
    assert got == [64, 64, 64, 64, 64, 64, 128, 256]
    assert dot_tile(256, 64) == 64 and dot_tile(16, 64) == 64 and dot_tile(16, 32) == 32


@pytest.mark.parametrize("config", CONFIGS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("K,V", [(16, 16), (48, 16), (16, 48), (128, 128), (256, 64), (64, 256)])
def test_configs_never_use_16_wide_blocks(config, K, V):
    cfg = config(K, V)
    assert cfg["BK"] >= 32 and cfg["BV"] >= 32, cfg
    assert cfg["BK"] & (cfg["BK"] - 1) == 0 and cfg["BV"] & (cfg["BV"] - 1) == 0, cfg
    if config in WHOLE_K:
        assert cfg["BK"] >= K, cfg


def test_state_backward_at_k256_uses_64_columns_on_8_warps():
    cfg = chunk_state_bwd_config(256, 64)
    assert (cfg["BK"], cfg["BV"], cfg["num_warps"]) == (256, 64, 8)
    assert chunk_state_bwd_config(128, 128)["BV"] == 32  # validated at K <= 128


@pytest.mark.parametrize("K,V", [(16, 16), (48, 16), (128, 128), (256, 64), (64, 256)])
def test_state_config_with_many_programs_keeps_whole_k_and_no_16_wide_blocks(K, V):
    for programs in (0, 127, 128, 4096):
        cfg = chunk_state_config(K, V, 2, programs=programs)
        assert cfg["BK"] >= K and cfg["BV"] >= 32, cfg
    assert chunk_state_config(128, 128, 2, programs=128)["BV"] == 64
    assert chunk_state_config(128, 128, 2, programs=127)["BV"] == 32
    assert chunk_state_config(128, 128, 4, programs=4096)["BV"] == 32  # fp32 unchanged
