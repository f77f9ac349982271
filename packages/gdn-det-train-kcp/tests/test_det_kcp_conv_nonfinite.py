"""KCP causal conv1d: a NaN or Inf in one document never reaches another (issue 20)."""

from gdn_core.suites.kcp_conv_nonfinite import *  # noqa: F403 - the shared tests, on this package
