"""Multi-process gloo worlds (2, 3 and 4 ranks) against the single-rank run — the
shared suite (:mod:`gdn_core.suites.kcp_distributed`) on this package: bitwise repeat
within a process, bitwise equality with the same world simulated in this process
(across processes), and ring == allgather bitwise."""

from gdn_core.suites.kcp_distributed import *  # noqa: F403 - the shared tests, on this package
