"""Saved sets and workspaces are typed per mode: a foreign one is refused by type.

The other package must not be imported here, not even in a test: its classes are
imitated by look-alikes that carry its module and class names (:data:`MODES`)
and the same attributes. Run on a single-rank package through its ``api`` fixture.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from gdn_core.compose import chunk_gdn_fwd as core_fwd
from gdn_core.testkit import make_inputs


class PackageNames(NamedTuple):
    """The public names of one single-rank package's mode."""

    module: str
    saved: str
    workspace: str
    mode: str


# keyed by the package's deterministic flag
MODES = {
    True: PackageNames("gdn_det_train", "DetSavedSet", "DetWorkspace", "deterministic"),
    False: PackageNames("gdn_train", "SavedSet", "Workspace", "non-deterministic"),
}


def own_and_other(api: Any) -> tuple[PackageNames, PackageNames]:
    """The names of ``api``'s package and of the package of the other mode."""
    return MODES[api.deterministic], MODES[not api.deterministic]


def _look_alike(api: Any, name: str, base: type = object, **attrs: Any) -> type:
    """A class named ``name`` in the other package's module."""
    cls = type(name, (base,), dict(attrs))
    cls.__module__ = own_and_other(api)[1].module
    cls.__qualname__ = name
    return cls


def _other_modes_saved(api: Any) -> tuple[Any, dict]:
    """An other-package-style saved set: the other mode's core saved state in a look-alike."""
    other = own_and_other(api)[1]
    inputs, cu, _ = make_inputs([20], seed=30)
    _, _, core = core_fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                          cu_seqlens=cu, deterministic=not api.deterministic)
    saved = _look_alike(api, other.saved, deterministic=not api.deterministic,
                        mode=other.mode)()
    saved.core, saved.gate, saved.shapes, saved.device = core, None, core.shapes, core.device
    return saved, inputs


class _Exploding:
    """Any attribute access fails: the check must be by type, before touching anything."""

    def __getattr__(self, name):
        raise AssertionError(f"attribute {name!r} was read")


def test_bwd_refuses_other_modes_saved_set(api):
    own, other = own_and_other(api)
    saved, inputs = _other_modes_saved(api)
    do = torch.zeros_like(inputs["v"])
    with pytest.raises(ValueError) as err:
        api.bwd(saved, do)
    msg = str(err.value)
    assert f"saved must be a {own.saved} ({own.mode})" in msg
    assert f"{other.module}.{other.saved} ({other.mode})" in msg


def test_bwd_refuses_core_saved_and_arbitrary_objects(api):
    own, other = own_and_other(api)
    inputs, cu, _ = make_inputs([20], seed=31)
    _, _, core = core_fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                          cu_seqlens=cu, deterministic=api.deterministic)
    do = torch.zeros_like(inputs["v"])
    with pytest.raises(ValueError, match=r"got gdn_core\.compose\.GDNSaved"):
        api.bwd(core, do)
    exploding = _look_alike(api, other.saved, _Exploding)()
    with pytest.raises(ValueError, match=rf"saved must be a {own.saved} .*got "
                                         rf"{other.module}\.{other.saved}"):
        api.bwd(exploding, do)
    with pytest.raises(ValueError, match="got builtins.NoneType"):
        api.bwd(None, do)


def test_bwd_refuses_other_modes_workspace(api):
    own, other = own_and_other(api)
    inputs, cu, cot = make_inputs([20], seed=32)
    _, _, saved = api.fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                          cu_seqlens=cu)
    workspace = _look_alike(api, other.workspace, _Exploding)()
    with pytest.raises(ValueError) as err:
        api.bwd(saved, cot["do"], workspace=workspace)
    assert (f"workspace must be a {own.workspace} ({own.mode}), got "
            f"{other.module}.{other.workspace}") in str(err.value)


def test_autograd_refuses_other_modes_workspace(api):
    own, other = own_and_other(api)
    inputs, cu, _ = make_inputs([20], seed=33)
    workspace = _look_alike(api, other.workspace, deterministic=not api.deterministic)()
    with pytest.raises(ValueError, match=rf"{own.workspace} \({own.mode}\), got "
                                         rf"{other.module}\.{other.workspace} \({other.mode}\)"):
        api.autograd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                     cu_seqlens=cu, workspace=workspace)


def _saved(api: Any, lengths: list[int], **kw: Any) -> tuple[Any, dict]:
    inputs, cu, cot = make_inputs(lengths, seed=34, **kw)
    _, _, saved = api.fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                          cu_seqlens=cu)
    return saved, cot


def test_workspace_too_small(api):
    saved, cot = _saved(api, [100, 100])
    ws_cls, own = api.workspace_cls, own_and_other(api)[0]
    small = ws_cls.for_shapes(T=150, H=1, HV=2, K=16, V=16, num_docs=2, device="cpu")
    with pytest.raises(ValueError, match=rf"too small: {own.workspace} holds tokens=150, "
                                         r".*tokens=200"):
        api.bwd(saved, cot["do"], workspace=small)
    few_docs = ws_cls.for_shapes(T=200, H=1, HV=2, K=16, V=16, num_docs=1, device="cpu")
    with pytest.raises(ValueError, match="too small"):
        api.bwd(saved, cot["do"], workspace=few_docs)


def test_workspace_other_head_sizes(api):
    saved, cot = _saved(api, [64])
    for kw in (dict(K=32, V=16, HV=2), dict(K=16, V=32, HV=2), dict(K=16, V=16, HV=1)):
        ws = api.workspace_cls.for_shapes(T=64, H=1, device="cpu", **kw)
        with pytest.raises(ValueError, match="does not fit"):
            api.bwd(saved, cot["do"], workspace=ws)


def test_workspace_other_device(api):
    saved, cot = _saved(api, [64])
    ws = api.workspace_cls.for_shapes(T=64, H=1, HV=2, K=16, V=16, device="meta")
    with pytest.raises(ValueError, match="allocated on meta, but the tensors are on cpu"):
        api.bwd(saved, cot["do"], workspace=ws)


def test_autograd_path_checks_workspace_before_running(api):
    inputs, cu, _ = make_inputs([40, 40], seed=35)
    ws = api.workspace_cls.for_shapes(T=64, H=1, HV=2, K=16, V=16, num_docs=2, device="cpu")
    with pytest.raises(ValueError, match="too small"):
        api.autograd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                     cu_seqlens=cu, workspace=ws)


def test_mode_tags(api):
    own = own_and_other(api)[0]
    saved_cls, ws_cls = api.saved_cls, api.workspace_cls
    assert saved_cls.mode == own.mode and ws_cls.mode == own.mode
    assert saved_cls.__module__ == own.module
    ws = ws_cls.for_shapes(T=64, H=1, K=16, V=16, device="cpu")
    assert f"{own.workspace}({own.mode}" in repr(ws)
