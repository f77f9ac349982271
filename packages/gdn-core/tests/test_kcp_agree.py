"""gdn_core.kcp.agree: the records ranks exchange at context build, decoded without a world.

(The real 2-process worlds are in the KCP packages' ``test_*kcp_agreement.py``.)
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.kcp.agree import FIELDS, RunSpec, agreement_error, make_record
from gdn_core.kcp.plan import KCPPlan, partition


class _DetPlan(KCPPlan):
    deterministic = True


class _FastPlan(KCPPlan):
    deterministic = False


SPEC = RunSpec.make(heads=(2, 4), head_dims=(16, 32), dtype=torch.bfloat16, exchange="ring")


def _records(plans, specs=(SPEC, SPEC), ranks=(0, 1), conv=(4, 4), errors=(False, False)):
    return [make_record(p, r, g, c, s, e)
            for g, (p, r, c, s, e) in enumerate(zip(plans, ranks, conv, specs, errors))]


def _plan(world=2, cls=_DetPlan, **kw):
    return partition([0, 100, 250], world, plan_cls=cls, **kw)


def test_a_record_has_a_fixed_length_whatever_is_declared():
    assert len(make_record(_plan(), 0, 0, None, None, False)) == len(FIELDS)
    assert len(make_record(None, "x", 1, "y", SPEC, True)) == len(FIELDS)


def test_agreeing_records_give_no_error():
    assert agreement_error(_records([_plan(), _plan()])) is None


@pytest.mark.parametrize("change, word", [
    (dict(plans=[_plan(), _plan(cls=_FastPlan)]), "deterministic: rank 0: 1, rank 1: 0"),
    (dict(plans=[_plan(), _plan(boundary="segment", segment_size=128)]), "segment_size"),
    (dict(plans=[_plan(), _plan(chunk_size=32)]), "chunk_size"),
    (dict(plans=[_plan(), _plan(3)]), "world_size: rank 0: 2, rank 1: 3"),
    (dict(plans=[_plan(3), _plan(3)]), "made for 3 ranks, but the process group has 2"),
    (dict(plans=[_plan(), _plan()], ranks=(1, 0)), "rank=1 in group rank 0"),
    (dict(plans=[_plan(), _plan()], conv=(4, None)), "conv_kernel_size: rank 0: 4, rank 1: unset"),
    (dict(plans=[_plan(), _plan()], specs=(SPEC, RunSpec.make(heads=(1, 4)))), "H: rank 0: 2"),
    (dict(plans=[_plan(), _plan()], specs=(SPEC, None)), "exchange: rank 0: ring, rank 1: unset"),
    (dict(plans=[_plan(), _plan()], specs=(SPEC, RunSpec.make(dtype=torch.float16))),
     "dtype: rank 0: bfloat16, rank 1: float16"),
    (dict(plans=[_plan(), partition([0, 99, 250], 2, plan_cls=_DetPlan)]), "digest mismatch"),
    (dict(plans=[_plan(), None], errors=(False, True)), "own checks on ranks [1] of 2"),
])
def test_each_disagreement_is_named(change, word):
    msg = agreement_error(_records(**change))
    assert msg is not None and word in msg, msg


def test_another_record_format_is_refused():
    recs = _records([_plan(), _plan()])
    recs[1][0] += 1
    assert "record formats" in agreement_error(recs)


@pytest.mark.parametrize("kw, err", [
    (dict(heads=(2, 3)), ValueError), (dict(heads=(0, 2)), ValueError),
    (dict(heads=2), ValueError), (dict(head_dims=(16, True)), ValueError),
    (dict(dtype=torch.int32), TypeError), (dict(dtype="float32"), TypeError),
    (dict(exchange="tree"), ValueError),
])
def test_bad_declarations_are_refused(kw, err):
    with pytest.raises(err):
        RunSpec.make(**kw)


def test_calls_are_held_to_the_declaration():
    SPEC.check_call(H=2, HV=4, K=16, V=32, dtype=torch.bfloat16, exchange="ring")
    with pytest.raises(ValueError, match=r"heads=\(2, 8\)"):
        SPEC.check_call(H=2, HV=8, K=16, V=32, dtype=torch.bfloat16, exchange="ring")
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        SPEC.check_call(H=2, HV=4, K=16, V=32, dtype=torch.float32, exchange="ring")
    RunSpec().check_call(H=1, HV=1, K=1, V=1, dtype=torch.float64, exchange="allgather")
