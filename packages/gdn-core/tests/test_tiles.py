"""Every kernel's pinned configuration keeps its K/V blocks at least MIN_DOT_TILE wide
(Triton 3.6 on Hopper faults on 16-wide dot dimensions) and covers or tiles the head."""

from __future__ import annotations

import pytest

from gdn_core.ops.chunk_state import chunk_state_config
from gdn_core.ops.chunk_state_bwd import chunk_state_bwd_config
from gdn_core.ops.dqkwg import dqkwg_config
from gdn_core.ops.dv_local import dv_local_config
from gdn_core.ops.output import chunk_output_config
from gdn_core.ops.tiles import MIN_DOT_TILE, dot_tile
from gdn_core.ops.wy import wy_config
from gdn_core.ops.wy_bwd import wy_bwd_config

CONFIGS = [chunk_state_config, chunk_state_bwd_config, dqkwg_config, dv_local_config,
           chunk_output_config, wy_config, wy_bwd_config]
WHOLE_K = {chunk_state_config, chunk_state_bwd_config}  # the state's rows live in one tile


def test_dot_tile():
    assert [dot_tile(n) for n in (1, 16, 17, 32, 48, 100, 256)] == [32, 32, 32, 32, 64, 128, 256]
    assert dot_tile(256, 64) == 64 and dot_tile(16, 64) == 32 and dot_tile(8, 16) == 32


@pytest.mark.parametrize("config", CONFIGS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("K,V", [(16, 16), (48, 16), (16, 48), (128, 128), (256, 64), (64, 256)])
def test_configs_never_use_16_wide_blocks(config, K, V):
    cfg = config(K, V)
    assert cfg["BK"] >= MIN_DOT_TILE and cfg["BV"] >= MIN_DOT_TILE, cfg
    assert cfg["BK"] & (cfg["BK"] - 1) == 0 and cfg["BV"] & (cfg["BV"] - 1) == 0, cfg
    if config in WHOLE_K:
        assert cfg["BK"] >= K, cfg
