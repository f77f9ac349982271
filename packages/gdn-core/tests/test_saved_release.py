"""The eager autograd call drops its saved set when its backward frees the graph.

A forward's intermediates (:class:`gdn_core.saved.GDNSaved`, a ``ctx`` attribute of the
node) go once a backward without ``retain_graph`` has run, even while the caller still
holds the output (a training loop's previous ``loss``): the previous step's intermediates
would otherwise overlap the next step's forward. With ``retain_graph=True`` a second
backward still works, bit for bit; and saved-tensor hooks that copy what they pack (CPU
offloading with pinned memory) see the inputs only, as before.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from gdn_core.autograd import chunk_gdn_autograd
from gdn_core.testkit import make_inputs


def _call(segment_size=None):
    inputs, _, cot = make_inputs(T=200, H=1, HV=2, K=16, V=16, dtype=torch.float32,
                                 device="cpu", initial_state=False)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    o, _ = chunk_gdn_autograd(*leaves.values(), cu_seqlens=[0, 150, 200], deterministic=True,
                              segment_size=segment_size)
    return o, leaves, cot["do"]


def _grads(leaves):
    out = {n: t.grad.clone() for n, t in leaves.items()}
    for t in leaves.values():
        t.grad = None
    return out


@pytest.mark.parametrize("segment_size", [0, 64])
def test_the_saved_set_goes_after_a_backward_while_the_output_lives(segment_size):
    o, _, do = _call(segment_size)
    ref = weakref.ref(o.grad_fn.core)
    gc.collect()
    assert ref() is not None
    o.backward(do)
    gc.collect()
    assert ref() is None, "the saved set outlived the backward (held by the graph node)"
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        o.backward(do)


def test_retain_graph_keeps_it_for_a_second_backward():
    o, leaves, do = _call()
    ref = weakref.ref(o.grad_fn.core)
    o.backward(do, retain_graph=True)
    first = _grads(leaves)
    gc.collect()
    assert ref() is not None
    o.backward(do)
    for n, t in _grads(leaves).items():
        assert torch.equal(t, first[n]), n
    gc.collect()
    assert ref() is None


def test_a_copying_saved_tensors_hook_leaves_the_backward_whole():
    """A hook that packs copies (as ``save_on_cpu(pin_memory=True)`` does) gives the same
    gradients: the saved set is not a saved tensor, so no hook can lose it."""
    o, leaves, do = _call()
    o.backward(do)
    want = _grads(leaves)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        o, _ = chunk_gdn_autograd(*leaves.values(), cu_seqlens=[0, 150, 200],
                                  deterministic=True)
    o.backward(do)
    for n, t in _grads(leaves).items():
        assert torch.equal(t, want[n]), n
