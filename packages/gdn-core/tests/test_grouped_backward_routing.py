"""The backward's routing of grouped value heads to the group-summing chunk-gradient launch.

Where the one-tile Gluon chunk-gradient kernel runs and each q/k head has several value
heads, :func:`gdn_core.ops.backward.backward_from_recompute` calls
``chunk_grads_bwd_gluon_summed`` (the group summed in the kernel, ``group_reduce``'s bits)
and no ``group_reduce``. The kernel itself runs only on an sm_90 GPU
(``test_gluon_chunk_grads_gpu.py`` checks its bits); here, on the CPU, the backward is made
to see the Triton launcher as the Gluon one and the summed launcher is replaced by the
Triton partials + ``group_reduce`` it must equal, so that what is checked is the wiring:
which launcher runs, what it gets (fresh ``[T, H, K]`` outputs; ``spend_states``: the
backward's own ``h`` and ``dh`` take the running sums) and that its results are the
gradients returned.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core import testkit
from gdn_core.ops import backward
from gdn_core.ops.chunk_grads_bwd import chunk_grads_bwd
from gdn_core.ops.gluon import chunk_grads as gluon_grads
from gdn_core.ops.group_reduce import group_reduce

D = 32


@pytest.mark.parametrize("workspace", [False, True], ids=["fresh", "workspace"])
def test_grouped_heads_take_the_summed_launch(monkeypatch, workspace):
    ins, cu, cot = testkit.make_inputs(lengths=[5, 64, 70, 130], H=2, HV=4, K=D, V=D)

    def run():
        return testkit.det_split_fwd_bwd(ins, cu, cot, segment_size=64, workspace=workspace)

    want, _ = run()  # the Triton pair + group_reduce

    calls = []

    def summed(*args, dq, dk, dv=None, dbeta=None, dg=None, spend_states=False):
        group = args[13]
        parts = chunk_grads_bwd(*args, dbeta=dbeta, dg=dg)  # fresh dv: the plan may alias
        dq.copy_(group_reduce(parts[0], group, dq.dtype))
        dk.copy_(group_reduce(parts[1], group, dk.dtype))
        if dv is not None:
            dv.copy_(parts[2])
        calls.append(dict(group=group, dq=dq, dk=dk, spend_states=spend_states))
        return dq, dk, parts[2] if dv is None else dv, parts[3], parts[4]

    def no_reduce(*args, **kwargs):
        raise AssertionError("group_reduce ran beside the summed launch")

    kind = backward.grads_kernel
    monkeypatch.setattr(backward, "grads_kernel",
                        lambda g: "gluon" if g is chunk_grads_bwd else kind(g))
    monkeypatch.setattr(gluon_grads, "chunk_grads_bwd_gluon_summed", summed)
    monkeypatch.setattr(backward, "group_reduce", no_reduce)
    got, _ = run()

    assert calls, "the summed launch did not run"
    T = ins["q"].shape[1]
    for call in calls:
        assert call["group"] == 2
        assert call["dq"].shape == (T, 2, D) and call["dq"].dtype == ins["q"].dtype
        assert call["spend_states"] is True  # the segment backward donates its h
    for name, a in want.items():
        if a is not None:
            assert torch.equal(a, got[name]), name
