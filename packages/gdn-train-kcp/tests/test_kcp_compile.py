"""torch.compile(fullgraph=True) of a small KCP GDN block: the shared suite
(:mod:`gdn_core.suites.kcp_compile`) on this package (the Triton interpreter run of the
static path is in gdn-det-train-kcp's tests: the code is gdn_core's)."""

from gdn_core.suites.kcp_compile import *  # noqa: F403 - the shared tests, on this package
