"""``gdn_core.switches``: the environment read on every call sees what ``os.environ`` holds
now (set, changed, emptied, removed), and the switches built on it raise on bad values."""

from __future__ import annotations

import os

import pytest
from gdn_core.switches import env_value, switch_choice, switch_setting

NAME = "GDN_CORE_TEST_SWITCH"


def test_env_value_follows_os_environ(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_value(NAME) == "" == os.environ.get(NAME, "")
    for value in ("1", "grads, wy", "", "é"):
        monkeypatch.setenv(NAME, value)
        assert env_value(NAME) == value == os.environ[NAME]
    os.environ[NAME] = "0"  # a plain assignment, not through monkeypatch
    assert env_value(NAME) == "0"
    del os.environ[NAME]
    assert env_value(NAME) == ""


def test_switches_read_through_it(monkeypatch):
    monkeypatch.setenv(NAME, " 1 ")
    assert switch_setting(NAME) is True
    monkeypatch.setenv(NAME, "0")
    assert switch_setting(NAME) is False
    monkeypatch.setenv(NAME, "")
    assert switch_setting(NAME) is None
    monkeypatch.setenv(NAME, "yes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        switch_setting(NAME)
    monkeypatch.setenv(NAME, "reg")
    assert switch_choice(NAME, ("subst", "reg"), "subst") == "reg"
    monkeypatch.delenv(NAME)
    assert switch_choice(NAME, ("subst", "reg"), "subst") == "subst"
    monkeypatch.setenv(NAME, "other")
    with pytest.raises(ValueError, match="expected one of"):
        switch_choice(NAME, ("subst", "reg"), "subst")
