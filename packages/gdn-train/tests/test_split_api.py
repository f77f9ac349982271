"""chunk_gdn_fwd / chunk_gdn_bwd equal the autograd path (on the CPU reference)."""

from gdn_core.suites.single_rank_split_api import *  # noqa: F403 - the shared tests, on this package
