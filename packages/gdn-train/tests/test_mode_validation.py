"""Saved sets and workspaces are typed per mode: a foreign one is refused by type.

The other package (``gdn_det_train``) must not be imported here, not even in a
test: its classes are imitated by look-alikes that carry the same module and
class names and the same attributes.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.compose import chunk_gdn_fwd as core_fwd
from gdn_train import SavedSet, Workspace, chunk_gated_delta_rule, chunk_gdn_bwd, chunk_gdn_fwd
from train_helpers import make_inputs


def _look_alike(name: str, base: type = object, **attrs) -> type:
    cls = type(name, (base,), dict(attrs))
    cls.__module__ = "gdn_det_train"
    cls.__qualname__ = name
    return cls


def _det_saved():
    """A gdn_det_train-style saved set: a deterministic core saved state in a look-alike."""
    inputs, cu, _ = make_inputs([20], seed=30)
    _, _, core = core_fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                          cu_seqlens=cu, deterministic=True)
    DetSavedSet = _look_alike("DetSavedSet", deterministic=True, mode="deterministic")
    saved = DetSavedSet()
    saved.core, saved.gate, saved.shapes, saved.device = core, None, core.shapes, core.device
    return saved, inputs


class _Exploding:
    """Any attribute access fails: the check must be by type, before touching anything."""

    def __getattr__(self, name):
        raise AssertionError(f"attribute {name!r} was read")


def test_bwd_refuses_other_modes_saved_set():
    saved, inputs = _det_saved()
    do = torch.zeros_like(inputs["v"])
    with pytest.raises(ValueError) as err:
        chunk_gdn_bwd(saved, do)
    msg = str(err.value)
    assert "saved must be a SavedSet (non-deterministic)" in msg
    assert "gdn_det_train.DetSavedSet (deterministic)" in msg


def test_bwd_refuses_core_saved_and_arbitrary_objects():
    inputs, cu, _ = make_inputs([20], seed=31)
    _, _, core = core_fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                          cu_seqlens=cu, deterministic=False)
    do = torch.zeros_like(inputs["v"])
    with pytest.raises(ValueError, match=r"got gdn_core\.compose\.GDNSaved"):
        chunk_gdn_bwd(core, do)
    exploding = _look_alike("DetSavedSet", _Exploding)()
    with pytest.raises(ValueError, match=r"saved must be a SavedSet .*gdn_det_train\.DetSavedSet"):
        chunk_gdn_bwd(exploding, do)
    with pytest.raises(ValueError, match="got builtins.NoneType"):
        chunk_gdn_bwd(None, do)


def test_bwd_refuses_other_modes_workspace():
    inputs, cu, cot = make_inputs([20], seed=32)
    _, _, saved = chunk_gdn_fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                                inputs["beta"], cu_seqlens=cu)
    DetWorkspace = _look_alike("DetWorkspace", _Exploding)
    with pytest.raises(ValueError) as err:
        chunk_gdn_bwd(saved, cot["do"], workspace=DetWorkspace())
    assert ("workspace must be a Workspace (non-deterministic), got "
            "gdn_det_train.DetWorkspace") in str(err.value)


def test_autograd_refuses_other_modes_workspace():
    inputs, cu, _ = make_inputs([20], seed=33)
    DetWorkspace = _look_alike("DetWorkspace", deterministic=True)
    with pytest.raises(ValueError, match=r"got gdn_det_train\.DetWorkspace \(deterministic\)"):
        chunk_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                               inputs["beta"], cu_seqlens=cu, workspace=DetWorkspace())


def _saved(lengths, **kw):
    inputs, cu, cot = make_inputs(lengths, seed=34, **kw)
    _, _, saved = chunk_gdn_fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                                inputs["beta"], cu_seqlens=cu)
    return saved, cot


def test_workspace_too_small():
    saved, cot = _saved([100, 100])
    small = Workspace.for_shapes(T=150, H=1, HV=2, K=16, V=16, num_docs=2, device="cpu")
    with pytest.raises(ValueError, match=r"too small: Workspace holds tokens=150, .*tokens=200"):
        chunk_gdn_bwd(saved, cot["do"], workspace=small)
    few_docs = Workspace.for_shapes(T=200, H=1, HV=2, K=16, V=16, num_docs=1, device="cpu")
    with pytest.raises(ValueError, match="too small"):
        chunk_gdn_bwd(saved, cot["do"], workspace=few_docs)


def test_workspace_other_head_sizes():
    saved, cot = _saved([64])
    for kw in (dict(K=32, V=16, HV=2), dict(K=16, V=32, HV=2), dict(K=16, V=16, HV=1)):
        ws = Workspace.for_shapes(T=64, H=1, device="cpu", **kw)
        with pytest.raises(ValueError, match="does not fit"):
            chunk_gdn_bwd(saved, cot["do"], workspace=ws)


def test_workspace_other_device():
    saved, cot = _saved([64])
    ws = Workspace.for_shapes(T=64, H=1, HV=2, K=16, V=16, device="meta")
    with pytest.raises(ValueError, match="allocated on meta, but the tensors are on cpu"):
        chunk_gdn_bwd(saved, cot["do"], workspace=ws)


def test_autograd_path_checks_workspace_before_running():
    inputs, cu, _ = make_inputs([40, 40], seed=35)
    ws = Workspace.for_shapes(T=64, H=1, HV=2, K=16, V=16, num_docs=2, device="cpu")
    with pytest.raises(ValueError, match="too small"):
        chunk_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                               inputs["beta"], cu_seqlens=cu, workspace=ws)


def test_mode_tags():
    assert SavedSet.mode == "non-deterministic" and Workspace.mode == "non-deterministic"
    assert SavedSet.__module__ == "gdn_train"
    ws = Workspace.for_shapes(T=64, H=1, K=16, V=16, device="cpu")
    assert "Workspace(non-deterministic" in repr(ws)
