"""chunk_gdn_det_fwd / chunk_gdn_det_bwd equal the autograd path."""

from gdn_core.suites.single_rank_split_api import *  # noqa: F403 - the shared tests, on this package
