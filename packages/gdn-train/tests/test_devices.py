"""A device this process cannot use is a ``ValueError`` naming it (issue 20) — the
shared suite (:mod:`gdn_core.suites.single_rank_devices`) on this package."""

from gdn_core.suites.single_rank_devices import *  # noqa: F403 - the shared tests, on this package
