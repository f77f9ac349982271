"""gdn_core.typed: mode tags, require_instance messages, workspace fit checks."""

from __future__ import annotations

import pytest
import torch
from gdn_core.typed import (
    ModeTyped,
    TypedSaved,
    TypedWorkspace,
    mode_name,
    mode_of,
    require_instance,
)


class DetThing(TypedSaved):
    deterministic = True


class FastThing(TypedSaved):
    deterministic = False


class Ws(TypedWorkspace):
    deterministic = True


def test_mode_tags():
    assert DetThing.mode == "deterministic" and FastThing.mode == "non-deterministic"
    assert TypedSaved.mode is None and ModeTyped.deterministic is None
    assert mode_name(True) == "deterministic" and mode_of(FastThing()) == "non-deterministic"
    with pytest.raises(TypeError):
        type("Bad", (ModeTyped,), {"deterministic": "yes"})


def test_require_instance():
    obj = DetThing()
    assert require_instance(obj, DetThing, "saved") is obj
    with pytest.raises(ValueError) as err:
        require_instance(FastThing(), DetThing, "saved")
    assert str(err.value) == (
        f"saved must be a DetThing (deterministic), got {__name__}.FastThing (non-deterministic)"
    )
    with pytest.raises(ValueError, match=r"^workspace must be a DetThing \(deterministic\), got "
                                         r"builtins\.int$"):
        require_instance(3, DetThing, "workspace")


def test_require_instance_never_trusts_the_object():
    class Hostile:
        def __getattr__(self, name):
            raise RuntimeError("touched")

    with pytest.raises(ValueError, match="Hostile"):
        require_instance(Hostile(), DetThing, "saved")


def test_workspace_fit():
    ws = Ws("cpu", {"tokens": 100}, {"K": 64})
    ws.check_fits("cpu", {"tokens": 100}, {"K": 64})
    with pytest.raises(ValueError, match="too small: Ws holds tokens=100, the problem needs "
                                         "tokens=101"):
        ws.check_fits("cpu", {"tokens": 101})
    with pytest.raises(ValueError, match="sized for K=64, the problem has K=128"):
        ws.check_fits("cpu", {}, {"K": 128})
    with pytest.raises(ValueError, match="allocated on cpu, but the tensors are on meta"):
        ws.check_fits(torch.device("meta"), {})
    with pytest.raises(ValueError, match="chunks=None"):
        ws.check_fits("cpu", {"chunks": 1})
