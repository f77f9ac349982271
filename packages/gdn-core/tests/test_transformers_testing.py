"""``gdn_core.transformers_testing`` finds transformers' torch function under each kind of
hook a modeling module may hold, without transformers installed: a plain function, a
``functools.wraps`` chain (transformers' fallback wrapper), a switch's dispatcher, and the
``nn.Module`` that the ``kernels`` package (a dependency of transformers since 5.25) makes
of a decorated function; anything else raises ``RuntimeError``."""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
from gdn_core.transformers_switch import _Dispatch
from gdn_core.transformers_testing import _torch_function

_SOURCE = '''
def torch_chunk_gated_delta_rule(x):
    return x + 1
'''


def _module() -> types.ModuleType:
    """A stand-in modeling module whose torch function is defined in its own file."""
    module = types.ModuleType("fake_modeling")
    module.__file__ = "/fake/modeling_fake.py"
    exec(compile(_SOURCE, module.__file__, "exec"), module.__dict__)  # noqa: S102
    return module


def _fallback(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapped


def _function_module(func):
    """Like ``kernels``' ``_create_func_module``: a module class whose forward closes over
    ``func``, instantiated."""

    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


@pytest.mark.parametrize("wrap", ["plain", "fallback", "kernels", "dispatch"])
def test_the_torch_function_is_found_under_every_hook(wrap):
    module = _module()
    fn = module.torch_chunk_gated_delta_rule
    hook = {"plain": lambda: fn, "fallback": lambda: _fallback(fn),
            "kernels": lambda: _function_module(_fallback(fn)),
            "dispatch": lambda: _Dispatch("torch_chunk_gated_delta_rule",
                                          _function_module(_fallback(fn)))}[wrap]()
    assert _torch_function(module, hook) is fn
    assert hook(1) == 2


def test_a_hook_over_another_files_function_raises():
    module = _module()
    with pytest.raises(RuntimeError, match="no torch function"):
        _torch_function(module, _function_module(lambda x: x))
    with pytest.raises(RuntimeError, match="no torch function"):
        _torch_function(module, torch.nn.Identity())
    assert "fake_modeling" not in sys.modules
