"""GPU tests (``pytest -m gpu``, two or more GPUs): real ranks over NCCL — the shared
suite (:mod:`gdn_core.suites.kcp_nccl`) on this package (values, not bits)."""

from gdn_core.suites.kcp_nccl import *  # noqa: F403 - the shared tests, on this package
