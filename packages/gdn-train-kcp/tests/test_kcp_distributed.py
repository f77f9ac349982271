"""Multi-process gloo worlds (2, 3 and 4 ranks) against the single-rank run — the
shared suite (:mod:`gdn_core.suites.kcp_distributed`) on this package: all within
tolerance (this package promises no bits; ``gdn_det_train_kcp`` tests those)."""

from gdn_core.suites.kcp_distributed import *  # noqa: F403 - the shared tests, on this package
