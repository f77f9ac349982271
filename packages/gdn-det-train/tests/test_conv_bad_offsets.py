"""causal_conv1d_det: a list ``cu_seqlens`` with a non-int entry is a ``TypeError`` (issue 20) —
the shared suite (:mod:`gdn_core.suites.single_rank_conv_bad_offsets`) on this package."""

from gdn_core.suites.single_rank_conv_bad_offsets import *  # noqa: F403 - the shared tests, on this package
