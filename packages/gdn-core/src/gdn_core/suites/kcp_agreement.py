"""Ranks that disagree fail at context build, on every rank, within seconds (issue 20).

A real gloo world of two runs :mod:`gdn_core.kcp.agree_checks` (the package's agree
worker): context builds whose arguments differ between the ranks in one respect each
(world size, rank, boundary, declared heads, head dimensions, dtype, exchange, conv
width), a bad argument or an unusable device on one rank, a declared context's
calls, and a split backward whose inputs one rank modified in place. Simulated
worlds: ranks whose tensors disagree raise ``ValueError``, and declared contexts hold
their calls to the declaration. Run on a KCP package by its test module
(``from … import *``) with its ``kcp_package`` (the imported package) and
``kcp_agree_worker`` (the worker script's path) fixtures.
"""

from __future__ import annotations

import pytest
import torch

import gdn_core.kcp.agree_checks as checks
from gdn_core.kcp.testing import run_gloo_world


@pytest.fixture(scope="module")
def outcomes(kcp_agree_worker):
    return run_gloo_world(2, kcp_agree_worker, "agreement_scenarios", timeout=180)


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
def test_simulated_ranks_that_disagree_raise_valueerror(kcp_package, dtypes, HVs):
    checks.check_simulated_disagreement(kcp_package, dtypes, HVs)


def test_simulated_calls_are_held_to_the_declaration(kcp_package):
    checks.check_simulated_declaration(kcp_package)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_valueerror(kcp_package):
    checks.check_cuda_refused(kcp_package)


def test_undeclared_calls_are_agreed_on_at_the_first_call(outcomes):
    checks.check_undeclared_calls(outcomes)


def test_check_inputs(kcp_package):
    checks.check_inputs_checked(kcp_package)


def test_inputs_modified_in_place_stop_every_rank(outcomes):
    checks.check_backward_in_place(outcomes)


def test_split_backward_refuses_inputs_modified_in_place(kcp_package):
    checks.check_split_backward_in_place(kcp_package)
