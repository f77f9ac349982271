"""A Workspace allocated once serves every step of a training loop."""

from gdn_core.suites.single_rank_workspace import *  # noqa: F403 - the shared tests, on this package
