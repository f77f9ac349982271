"""GPU tests (``pytest -m gpu``): the compiled block on the Triton kernels, and a
training step captured in a CUDA graph replayed for new document layouts — the
shared suite (:mod:`gdn_core.suites.single_rank_compile_gpu`) on this package
(eager's values: this package promises no bits)."""

from gdn_core.suites.single_rank_compile_gpu import *  # noqa: F403 - the shared tests, on this package
