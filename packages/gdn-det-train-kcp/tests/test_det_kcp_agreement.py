"""Ranks that disagree fail at context build, on every rank, within seconds (issue 20)."""

from gdn_core.suites.kcp_agreement import *  # noqa: F403 - the shared tests, on this package
