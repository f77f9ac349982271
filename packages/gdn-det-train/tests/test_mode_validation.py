"""Saved sets and workspaces are typed per mode: a foreign one is refused by type.

The shared suite (:mod:`gdn_core.suites.single_rank_mode_typing`) on this package;
``gdn_train`` is not imported, only imitated by look-alikes.
"""

from gdn_core.suites.single_rank_mode_typing import *  # noqa: F403 - the shared tests, on this package
