"""The launcher registry: declarations cost no frame, recording sees every call."""

from __future__ import annotations

import sys

from gdn_core.ops.registry import launcher, record_launches, registered_launchers


@launcher(uses_atomics=False)
def _plain(x: int) -> int:
    return x + 1


@launcher(uses_atomics=True)
def _atomic(x: int) -> int:
    return _plain(x) * 2


def test_declaration_returns_the_function_itself():
    assert _plain.__name__ == "_plain" and _plain.__code__.co_name == "_plain"
    assert _plain.launcher_info.uses_atomics is False
    assert registered_launchers()[f"{__name__}._plain"].uses_atomics is False


def test_recording_in_call_order_nested_and_restored():
    seen = []

    def outer_hook(frame, event, arg):
        seen.append(event)

    sys.setprofile(outer_hook)
    try:
        with record_launches() as outer:
            _plain(1)
            with record_launches() as inner:
                assert _atomic(1) == 4
            assert sys.getprofile() is not None
        assert sys.getprofile() is outer_hook  # the previous profile hook is back
    finally:
        sys.setprofile(None)
    assert [(x.name.rsplit(".", 1)[-1], x.uses_atomics) for x in inner] == [
        ("_atomic", True), ("_plain", False)]
    assert [x.name.rsplit(".", 1)[-1] for x in outer] == ["_plain", "_atomic", "_plain"]
    assert "call" in seen  # the previous hook still saw events inside the blocks
    with record_launches() as none:
        pass
    assert none == []
    _plain(0)  # outside any block nothing records
    assert [x.name.rsplit(".", 1)[-1] for x in outer] == ["_plain", "_atomic", "_plain"]
