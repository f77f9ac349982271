"""The launch cache's specialisation key (gdn_core.ops.launch).

A cached launch reuses the kernel Triton compiled for an earlier call, so its key must
separate every pair of calls Triton would compile differently: these tests build the
key of a real ``@triton.jit`` signature (a ``JITFunction`` made directly, whatever
``TRITON_INTERPRET`` says) and check each distinction. The cached launch itself runs
only on CUDA (``tests/test_launch_gpu.py``); on CPU every launch goes through Triton.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from gdn_core.ops.launch import CachedLauncher
from triton.runtime.jit import JITFunction


def _kernel(x, y, n, scale, flag, opt, BLOCK: tl.constexpr, MODE: tl.constexpr = "a"):
    pass


@pytest.fixture
def cached() -> CachedLauncher:
    return CachedLauncher(JITFunction(_kernel))


def _key(cached: CachedLauncher, *args, device: int = 0, **kwargs):
    return cached.call_key(device, args, kwargs)[0]


def _args(**over):
    base = dict(x=torch.zeros(8), y=torch.zeros(8, dtype=torch.float16), n=7, scale=0.5,
                flag=True, opt=None)
    base.update(over)
    return tuple(base.values())


def test_tail_orders_the_later_parameters_and_applies_defaults(cached):
    assert cached.tail(6, {"BLOCK": 16}) == (16, "a")
    assert cached.tail(6, {"BLOCK": 16, "MODE": "b", "num_warps": 4}) == (16, "b")
    assert cached.tail(7, {}) == ("a",)  # BLOCK given positionally
    assert cached.tail(6, {}) is None  # BLOCK missing: Triton reports it


def test_equal_calls_share_a_key_and_launch_options_count(cached):
    a = _key(cached, *_args(), BLOCK=16, num_warps=4)
    assert a == _key(cached, *_args(), BLOCK=16, num_warps=4)
    assert a != _key(cached, *_args(), BLOCK=16, num_warps=8)
    assert a != _key(cached, *_args(), BLOCK=16)
    assert a != _key(cached, *_args(), BLOCK=16, num_warps=4, device=1)


def test_constexpr_values_are_part_of_the_key(cached):
    assert _key(cached, *_args(), BLOCK=16) != _key(cached, *_args(), BLOCK=32)
    assert _key(cached, *_args(), BLOCK=16) != _key(cached, *_args(), BLOCK=16, MODE="b")


def test_tensor_dtype_and_alignment_are_part_of_the_key(cached):
    buf = torch.zeros(64)
    aligned = _key(cached, *_args(x=buf[4:]), BLOCK=16)  # 16 bytes in: still aligned
    assert aligned == _key(cached, *_args(x=buf), BLOCK=16)
    assert aligned != _key(cached, *_args(x=buf[1:]), BLOCK=16)  # 4 bytes in
    assert aligned != _key(cached, *_args(x=buf.double()), BLOCK=16)


def test_int_arguments_key_on_what_triton_specialises(cached):
    def k(n):
        return _key(cached, *_args(n=n), BLOCK=16)

    assert k(7) == k(9)  # neither 1 nor a multiple of 16: one kernel serves both
    assert k(32) == k(48)
    assert len({k(1), k(7), k(32), k(2**31), k(2**63)}) == 5


def test_float_bool_none_key_on_kind_not_value(cached):
    assert _key(cached, *_args(scale=0.5), BLOCK=16) == _key(cached, *_args(scale=2.0), BLOCK=16)
    assert _key(cached, *_args(flag=True), BLOCK=16) == _key(cached, *_args(flag=False), BLOCK=16)
    assert _key(cached, *_args(opt=None), BLOCK=16) != _key(cached, *_args(opt=3), BLOCK=16)


def test_an_argument_of_another_kind_takes_tritons_path(cached):
    assert _key(cached, *_args(opt=object()), BLOCK=16) is None
    assert _key(cached, *_args(opt=[1, 2]), BLOCK=16) is None


def test_a_runtime_argument_by_keyword_takes_tritons_path(cached):
    x = torch.zeros(8)
    assert _key(cached, x, y=x, n=7, scale=0.5, flag=True, opt=None, BLOCK=16) is None


def test_a_positional_constexpr_keys_on_its_value(cached):
    a = _key(cached, *_args(), 16)
    assert a is not None and a == _key(cached, *_args(), 16)
    assert a != _key(cached, *_args(), 32)
    assert a != _key(cached, *_args(), BLOCK=16)  # the same call spelled otherwise: apart


def test_without_a_compiled_kernel_the_wrapper_is_the_kernel():
    class Plain:
        def __getitem__(self, grid):
            return ("plain", grid)

    assert CachedLauncher(Plain())[(3, 1)] == ("plain", (3, 1))


def test_a_gluon_descriptor_keys_on_dtype_block_and_layout(cached):
    tma = pytest.importorskip("gdn_core.ops.gluon.tma")
    if tma.TensorDescriptor is None:
        pytest.skip("this Triton has no Gluon TMA descriptor")

    def k(x, block):
        return _key(cached, *_args(opt=tma.descriptor(x, block)), BLOCK=16)

    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    b = torch.ones(512, 128, dtype=torch.bfloat16)  # other base, other rows: runtime values
    assert k(a, [64, 128]) == k(b, [64, 128])
    assert k(a, [64, 128]) != k(a, [64, 64])
    assert k(a, [64, 128]) != k(a.half(), [64, 128])


def test_a_cached_launch_passes_tensors_as_their_addresses(cached):
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.float16)
    args = (x, y, 7, 0.5, True, None)
    key, head = cached.call_key(0, args, {"BLOCK": 16})
    assert head == [x.data_ptr(), y.data_ptr(), 7, 0.5, True, None]
    assert [*head, *cached.tail(len(args), {"BLOCK": 16})][-2:] == [16, "a"]
    assert args[0] is x  # the call's own arguments are left as they are
    # a tensor off CUDA keys apart from a CUDA one (these are CPU: is_cuda False)
    assert key[3] == (torch.float32, True, False)


def _cached_launch_calls(source: str):
    """``(line, wrapper name, runtime parameters passed by keyword)`` of every
    ``WRAPPER[grid](...)`` call in ``source`` where ``WRAPPER = cached_launch(kernel)`` and
    ``kernel`` is defined in the same module (a parameter is runtime unless annotated
    ``constexpr``; a ``**mapping`` counts as ``None`` unless it is named ``constexprs``,
    the launchers' name for a dict of constexprs and launch options)."""
    import ast

    tree = ast.parse(source)
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    runtime: dict[str, set[str]] = {}
    for n in ast.walk(tree):
        if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                and getattr(n.value.func, "id", None) == "cached_launch"
                and isinstance(n.value.args[0], ast.Name) and n.value.args[0].id in defs):
            params = defs[n.value.args[0].id].args.args
            names = {a.arg for a in params
                     if a.annotation is None or "constexpr" not in ast.unparse(a.annotation)}
            runtime.update({t.id: names for t in n.targets if isinstance(t, ast.Name)})
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
                and isinstance(n.func.value, ast.Name) and n.func.value.id in runtime):
            by_keyword = [kw.arg for kw in n.keywords  # ``**constexprs``: by convention
                          if (kw.arg is None and getattr(kw.value, "id", "") != "constexprs")
                          or kw.arg in runtime[n.func.value.id]]
            yield n.lineno, n.func.value.id, by_keyword


def test_the_scan_finds_a_runtime_argument_by_keyword():
    src = ("import triton\n@triton.jit\ndef _k(x, n, B: tl.constexpr):\n    pass\n"
           "_K = cached_launch(_k)\n_K[(1,)](x, n=3, B=4)\n_K[(1,)](x, 3, B=4, num_warps=2)\n"
           "_K[(1,)](**d)\n_K[(1,)](x, 3, **constexprs)\n")
    assert list(_cached_launch_calls(src)) == [(6, "_K", ["n"]), (7, "_K", []),
                                               (8, "_K", [None]), (9, "_K", [])]


def test_every_cached_launch_in_the_library_passes_runtime_arguments_positionally():
    """A runtime argument by keyword (or a ``**mapping`` that may hold one) makes every
    call of that launch go through Triton's binding (tens of µs of host time each,
    ``launch.py``'s docstring): the launchers pass them positionally, constexprs and
    options by keyword. (The Gluon WY forward passed its tensors by keyword until
    session 23: one slow launch in every forward.)"""
    from pathlib import Path

    import gdn_core

    root = Path(gdn_core.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        for line, name, by_keyword in _cached_launch_calls(path.read_text()):
            found[f"{path.relative_to(root)}:{line} {name}"] = by_keyword
    assert len(found) >= 25, sorted(found)  # the scan sees the library's launches
    assert {site: kw for site, kw in found.items() if kw} == {}


def test_the_int_key_memo_gives_the_computed_keys():
    """An int's key comes from a memo once seen: equal to the key computed afresh, for the
    edges Triton specialises on, and the memo stays bounded."""
    from gdn_core.ops import launch

    edges = [0, 1, 2, 15, 16, -16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1,
             2**63, -(2**63)]
    fresh = [launch._int_key(v) for v in edges]
    launch._INT_KEYS.clear()
    assert [launch._int_key(v) for v in edges] == fresh
    assert [launch._INT_KEYS[v] for v in edges] == fresh
    for v in range(launch._INT_KEYS_MAX + 10):
        launch._int_key(v)
    assert len(launch._INT_KEYS) <= launch._INT_KEYS_MAX
