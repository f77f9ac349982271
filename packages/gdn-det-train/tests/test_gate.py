"""The in-kernel gate: gradients of A_log, dt_bias and the raw g against autograd
of the formula −exp(A_log)·softplus(g + dt_bias) feeding the fp32 oracle."""

from gdn_core.suites.single_rank_gate import *  # noqa: F403 - the shared tests, on this package
