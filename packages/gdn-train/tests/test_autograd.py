"""chunk_gated_delta_rule (autograd) against the fp32 token-by-token oracle."""

from gdn_core.suites.single_rank_autograd import *  # noqa: F403 - the shared tests, on this package
