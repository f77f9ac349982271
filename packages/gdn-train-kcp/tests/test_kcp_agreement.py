"""Ranks that disagree fail at context build, on every rank, within seconds (issue 20).

A real gloo world of two runs :mod:`gdn_core.kcp.agree_checks` (kcp_agree_worker.py): context
builds whose arguments differ between the ranks in one respect each (world
size, rank, boundary, declared heads, head dimensions, dtype, exchange, conv
width), a bad argument or an unusable device on one rank, and a declared
context's calls. Simulated worlds: ranks whose tensors disagree raise
``ValueError``, and declared contexts hold their calls to the declaration.
"""

from __future__ import annotations

from pathlib import Path

import gdn_core.kcp.agree_checks as checks
import gdn_train_kcp as kcp
import pytest
import torch
from gdn_core.kcp.testing import run_gloo_world

WORKER = Path(__file__).with_name("kcp_agree_worker.py")


@pytest.fixture(scope="module")
def outcomes():
    return run_gloo_world(2, WORKER, "agreement_scenarios", timeout=180)


@pytest.mark.parametrize("name", sorted(checks.DISAGREEMENTS))
def test_disagreement_raises_the_same_error_on_every_rank(outcomes, name):
    checks.check_disagreement(outcomes, name)


def test_a_bad_argument_on_one_rank_stops_every_rank(outcomes):
    checks.check_one_rank_failed(outcomes, "local_error", "conv_kernel_size")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unusable_device_on_one_rank_stops_every_rank(outcomes):
    checks.check_one_rank_failed(outcomes, "device", "CUDA is not available")


def test_calls_are_held_to_the_declaration(outcomes):
    checks.check_calls(outcomes)



@pytest.mark.parametrize("dtypes, HVs", [((torch.float32, torch.float64), (2, 2)),
                                         ((torch.float32, torch.float32), (2, 4))])
def test_simulated_ranks_that_disagree_raise_valueerror(dtypes, HVs):
    checks.check_simulated_disagreement(kcp, dtypes, HVs)


def test_simulated_calls_are_held_to_the_declaration():
    checks.check_simulated_declaration(kcp)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_valueerror():
    checks.check_cuda_refused(kcp)


def test_undeclared_calls_are_agreed_on_at_the_first_call(outcomes):
    checks.check_undeclared_calls(outcomes)


def test_check_inputs():
    checks.check_inputs_checked(kcp)
