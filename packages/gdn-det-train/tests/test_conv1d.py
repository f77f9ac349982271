"""causal_conv1d_det against torch.nn.functional.conv1d, one document at a time."""

from gdn_core.suites.single_rank_conv1d import *  # noqa: F403 - the shared tests, on this package
