"""On the H200 (``pytest -m gpu``): bf16 CUDA kernels against the fp32 oracle — the
shared suite (:mod:`gdn_core.suites.single_rank_gpu`) on this package."""

from gdn_core.suites.single_rank_gpu import *  # noqa: F403 - the shared tests, on this package
