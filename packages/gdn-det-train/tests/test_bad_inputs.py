"""Bad input is refused from the public API, naming the public argument."""

from gdn_core.suites.single_rank_bad_inputs import *  # noqa: F403 - the shared tests, on this package
