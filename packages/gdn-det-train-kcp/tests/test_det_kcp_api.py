"""In-process tests: world of one, simulated worlds, validation and mode typing — the
shared suite (:mod:`gdn_core.suites.kcp_in_process`) on this package (bitwise where
this package promises bits)."""

from gdn_core.suites.kcp_in_process import *  # noqa: F403 - the shared tests, on this package
