"""Fail closed (issue 20): what the GDN calls refuse or define (shared suite)."""

from gdn_core.suites.single_rank_fail_closed import *  # noqa: F403 - the shared tests, on this package
