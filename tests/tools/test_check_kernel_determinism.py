"""tools/check_kernel_determinism.py catches atomics behind atomic-free launchers."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "check_kernel_determinism", ROOT / "tools" / "check_kernel_determinism.py")
checker = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = checker  # dataclasses look their module up
_spec.loader.exec_module(checker)

HEADER = """
import triton
import triton.language as tl
from gdn_core.ops.registry import launcher
"""


def _write(tmp_path: Path, body: str) -> Path:
    pkg = tmp_path / "pkg" / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "kernels.py").write_text(HEADER + textwrap.dedent(body))
    return tmp_path


def test_repo_is_clean():
    assert checker.check(ROOT / "packages") == []


def test_counts_every_repo_kernel():
    jits: dict = {}
    launchers: list = []
    for path in (ROOT / "packages").rglob("*.py"):
        if "tests" not in path.parts:
            checker._scan_file(path, jits, launchers)
    assert len(jits) >= 15 and len(launchers) >= 14
    assert any(ln.uses_atomics for ln in launchers)  # the atomic group reduce is declared


def test_direct_atomic_in_atomic_free_launcher(tmp_path):
    root = _write(tmp_path, """
        @triton.jit
        def _k(x):
            tl.atomic_add(x, 1.0)

        @launcher(uses_atomics=False, kernels=(_k,))
        def run(x):
            _k[(1,)](x)
    """)
    findings = checker.check(root)
    assert len(findings) == 1
    assert "kernels.py:8: tl.atomic_* reachable from launcher run" in findings[0]


def test_atomic_in_helper_reports_chain(tmp_path):
    root = _write(tmp_path, """
        @triton.jit
        def _helper(x):
            tl.atomic_max(x, 1.0)

        @triton.jit
        def _k(x):
            _helper(x)

        @launcher(uses_atomics=False, kernels=(_k,))
        def run(x):
            _k[(1,)](x)
    """)
    (finding,) = checker.check(root)
    assert "chain _k -> _helper" in finding



def test_gluon_kernel_atomic_in_atomic_free_launcher(tmp_path):
    """``@gluon.jit`` kernels are scanned like ``@triton.jit`` ones (``gl.atomic_*``)."""
    root = _write(tmp_path, """
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl

        @gluon.jit
        def _helper(x):
            gl.atomic_add(x, 1.0)

        @gluon.jit
        def _k(x):
            _helper(x)

        @launcher(uses_atomics=False, kernels=(_k,))
        def run(x):
            _k[(1,)](x)

        @gluon.jit
        def _orphan(x):
            pass
    """)
    findings = checker.check(root)
    assert len(findings) == 2, findings
    assert "tl.atomic_* reachable from launcher run" in findings[0]
    assert "_k -> _helper" in findings[0]
    assert "kernel _orphan is launched by no declared launcher" in findings[1]

def test_declared_atomic_launcher_is_allowed(tmp_path):
    root = _write(tmp_path, """
        @triton.jit
        def _k(x):
            tl.atomic_add(x, 1.0)

        @launcher(uses_atomics=True, kernels=(_k,))
        def run(x):
            _k[(1,)](x)
    """)
    assert checker.check(root) == []


@pytest.mark.parametrize("body, needle", [
    ("""
        @triton.jit
        def _orphan(x):
            pass
     """, "launched by no declared launcher"),
    ("""
        @triton.autotune(configs=[], key=[])
        @triton.jit
        def _k(x):
            pass

        @launcher(uses_atomics=False, kernels=(_k,))
        def run(x):
            _k[(1,)](x)
     """, "is autotuned"),
])
def test_unregistered_and_autotuned_kernels(tmp_path, body, needle):
    findings = checker.check(_write(tmp_path, body))
    assert len(findings) == 1 and needle in findings[0]


def test_cli_exit_codes(tmp_path, capsys):
    assert checker.main(["--root", str(ROOT / "packages")]) == 0
    bad = _write(tmp_path, """
        @triton.jit
        def _orphan(x):
            pass
    """)
    assert checker.main(["--root", str(bad)]) == 1
    assert "_orphan" in capsys.readouterr().out


TL_HEADER = """
import tilelang
import tilelang.language as T
from gdn_core.ops.registry import launcher
"""


def _write_tl(tmp_path: Path, body: str) -> Path:
    pkg = tmp_path / "pkg" / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "tl_kernels.py").write_text(TL_HEADER + textwrap.dedent(body))
    return tmp_path


@pytest.mark.parametrize("atomic, expected", [(True, 1), (False, 0)])
def test_tilelang_atomic_in_a_module_with_an_atomic_free_launcher(tmp_path, atomic, expected):
    op = "T.atomic_add(y[i], x[i])" if atomic else "y[i] = x[i]"
    root = _write_tl(tmp_path, f"""
        def _build():
            @T.prim_func
            def k(x: T.Tensor((8,), "float32"), y: T.Tensor((8,), "float32")):
                with T.Kernel(1, threads=32):
                    for i in T.Parallel(8):
                        {op}
            return tilelang.compile(k)

        @launcher(uses_atomics=False)
        def run(x, y):
            _build()(x, y)
    """)
    findings = checker.check(root)
    assert len(findings) == expected
    if atomic:
        assert "TileLang atomic T.atomic_add" in findings[0]


def test_tilelang_autotune_is_refused(tmp_path):
    root = _write_tl(tmp_path, """
        @tilelang.autotune(configs=[{"threads": 128}])
        @tilelang.jit
        def k(threads=128):
            pass

        @launcher(uses_atomics=False)
        def run(x):
            k()(x)
    """)
    findings = checker.check(root)
    assert len(findings) == 1 and "tilelang.autotune" in findings[0]


def test_tilelang_atomic_allowed_behind_an_atomic_launcher(tmp_path):
    root = _write_tl(tmp_path, """
        def _build():
            @T.prim_func
            def k(x: T.Tensor((8,), "float32")):
                with T.Kernel(1, threads=32):
                    T.atomic_add(x[0], 1.0)
            return tilelang.compile(k)

        @launcher(uses_atomics=True)
        def run(x):
            _build()(x)
    """)
    assert checker.check(root) == []
