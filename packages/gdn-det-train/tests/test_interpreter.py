"""The Triton path on CPU: the real kernels under TRITON_INTERPRET=1 against the fp32
oracle, plus bitwise repeatability of the kernels and the same bits for row-strided
input views (the segment path) as for copies — the shared suite
(:mod:`gdn_core.suites.single_rank_interpreter`) on this package."""

from gdn_core.suites.single_rank_interpreter import *  # noqa: F403 - the shared tests, on this package
