"""Tests of tools/check_import_independence.py on throwaway package trees
(and on the real repository)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKER = REPO_ROOT / "tools" / "check_import_independence.py"

# A three-package toy repo: ``alpha`` is the shared core, ``beta`` and
# ``gamma`` may import ``alpha`` only.
TOY_CONFIG = """\
[tool.gdn-import-check]
packages-dir = "packages"

[tool.gdn-import-check.allowed]
alpha = []
beta = ["alpha"]
gamma = ["alpha"]
"""

MARK = "<-- HERE"


class ToyRepo:
    def __init__(self, root: Path):
        self.root = root

    def write(self, rel: str, text: str) -> Path:
        """Write ``text`` (dedented) at ``rel`` below the root."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    def module(self, package: str, rel: str, text: str) -> Path:
        """Write a module of toy package ``package`` (``rel`` below its import dir)."""
        return self.write(f"packages/{package}-pkg/src/{package}/{rel}", text)

    @staticmethod
    def line_of(path: Path, marker: str = MARK) -> int:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if marker in line:
                return n
        raise AssertionError(f"{marker!r} not in {path}")

    def loc(self, path: Path, marker: str = MARK) -> str:
        """``rel/path.py:LINE:`` as the checker prints it (modulo an absolute prefix)."""
        return f"{path.relative_to(self.root).as_posix()}:{self.line_of(path, marker)}:"


@pytest.fixture
def toy(tmp_path: Path) -> ToyRepo:
    repo = ToyRepo(tmp_path / "repo")
    repo.write("pyproject.toml", TOY_CONFIG)
    for name in ("alpha", "beta", "gamma"):
        repo.module(name, "__init__.py", f'"""Toy package {name}."""\n\n__version__ = "1.0"\n')
    repo.module("gamma", "sub.py", "thing = 1\n")
    repo.module("alpha", "util.py", "def helper():\n    return 1\n")
    return repo


@pytest.fixture
def run_checker() -> Callable[..., subprocess.CompletedProcess]:
    def _run(root: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, str(CHECKER), "--root", str(root), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        # pytest shows this on failure
        print(f"rc={proc.returncode}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}")
        return proc

    return _run


# ---------------------------------------------------------------- static ---

# (file below beta/, source with the offending line marked, forbidden module, kind)
STATIC_CASES = {
    "plain import": ("mod.py", "import os\nimport gamma  # <-- HERE\n", "gamma", "static"),
    "plain dotted import": (
        "mod.py",
        "import gamma.sub as gs  # <-- HERE\n",
        "gamma.sub",
        "static",
    ),
    "import inside a function": (
        "mod.py",
        "def f():\n    import gamma  # <-- HERE\n    return gamma\n",
        "gamma",
        "static",
    ),
    "from import": ("mod.py", "from gamma.sub import thing  # <-- HERE\n", "gamma.sub", "static"),
    "from import of top": ("mod.py", "from gamma import sub  # <-- HERE\n", "gamma", "static"),
    "relative import escaping the package": (
        "mod.py",
        "from . import mod2\nfrom .. import gamma  # <-- HERE\n",
        "gamma",
        "static",
    ),
    "relative from-module escaping the package": (
        "mod.py",
        "from ..gamma.sub import thing  # <-- HERE\n",
        "gamma.sub",
        "static",
    ),
    "relative import escaping from a subpackage": (
        "inner/mod.py",
        "from ...gamma import sub  # <-- HERE\n",
        "gamma",
        "static",
    ),
    "importlib.import_module literal": (
        "mod.py",
        'import importlib\n\nimportlib.import_module("gamma.sub")  # <-- HERE\n',
        "gamma.sub",
        "dynamic literal",
    ),
    "import_module imported from importlib": (
        "mod.py",
        'from importlib import import_module as im\n\n\ndef f():\n    im("gamma")  # <-- HERE\n',
        "gamma",
        "dynamic literal",
    ),
    "import_module through a module alias": (
        "mod.py",
        'import importlib as il\n\nil.import_module(  # <-- HERE\n    "gamma"\n)\n',
        "gamma",
        "dynamic literal",
    ),
    "import_module relative with literal package=": (
        "mod.py",
        'import importlib\n\nimportlib.import_module(".sub", package="gamma")  # <-- HERE\n',
        "gamma.sub",
        "dynamic literal",
    ),
    "import_module relative escaping __package__": (
        "mod.py",
        'import importlib\n\nimportlib.import_module("..gamma", __package__)  # <-- HERE\n',
        "gamma",
        "dynamic literal",
    ),
    "__import__ literal": (
        "mod.py",
        'm = __import__("gamma")  # <-- HERE\n',
        "gamma",
        "dynamic literal",
    ),
    "builtins.__import__ literal": (
        "mod.py",
        'import builtins\n\nbuiltins.__import__("gamma.sub")  # <-- HERE\n',
        "gamma.sub",
        "dynamic literal",
    ),
    "__import__ with level": (
        "mod.py",
        'm = __import__("gamma", globals(), None, [], 2)  # <-- HERE\n',
        "gamma",
        "dynamic literal",
    ),
    "importlib.util.find_spec literal": (
        "mod.py",
        'import importlib.util\n\nif importlib.util.find_spec("gamma"):  # <-- HERE\n    pass\n',
        "gamma",
        "dynamic literal",
    ),
    "find_spec imported from importlib.util": (
        "mod.py",
        'from importlib.util import find_spec\n\nfind_spec("gamma.sub")  # <-- HERE\n',
        "gamma.sub",
        "dynamic literal",
    ),
    "constant-folded name": (
        "mod.py",
        'import importlib\n\nimportlib.import_module("gam" + f"ma")  # <-- HERE\n',
        "gamma",
        "dynamic literal",
    ),
}


@pytest.mark.parametrize("case", sorted(STATIC_CASES))
def test_static_violation_found(case, toy, run_checker):
    rel, source, forbidden, kind = STATIC_CASES[case]
    if rel.startswith("inner/"):
        toy.module("beta", "inner/__init__.py", "")
    toy.module("beta", "mod2.py", "")
    path = toy.module("beta", rel, source)
    proc = run_checker(toy.root, "--static-only")
    assert proc.returncode == 1
    expected = f"{toy.loc(path)} package beta imports forbidden {forbidden} ({kind})"
    assert expected in proc.stdout
    # exactly one finding line
    assert len([ln for ln in proc.stdout.splitlines() if ": package beta " in ln]) == 1


_FUNC = "\n\n\ndef f(name):\n    return {call}{{c}}\n"
NON_LITERAL_CASES = {
    "import_module(variable)": "import importlib"
    + _FUNC.format(call="importlib.import_module(name)"),
    "import_module relative, package variable": "import importlib"
    + _FUNC.format(call="importlib.import_module('.x', package=name)"),
    "__import__(variable)": "import os" + _FUNC.format(call="__import__(name)"),
    "find_spec(f-string)": "from importlib.util import find_spec"
    + _FUNC.format(call="find_spec(f'gamma{{name}}')"),
}


@pytest.mark.parametrize("case", sorted(NON_LITERAL_CASES))
def test_non_literal_dynamic_import_found(case, toy, run_checker):
    path = toy.module("beta", "mod.py", NON_LITERAL_CASES[case].format(c="  # <-- HERE"))
    proc = run_checker(toy.root, "--static-only")
    assert proc.returncode == 1
    line = next(ln for ln in proc.stdout.splitlines() if toy.loc(path) in ln)
    assert "package beta imports forbidden <non-literal:" in line
    assert line.endswith("(dynamic non-literal)")
    assert "import-check: allow-dynamic" in proc.stdout  # the hint


@pytest.mark.parametrize("case", sorted(NON_LITERAL_CASES))
def test_allow_comment_suppresses_non_literal(case, toy, run_checker):
    comment = "  # import-check: allow-dynamic (plugin registry, names from config)"
    toy.module("beta", "mod.py", NON_LITERAL_CASES[case].format(c=comment))
    proc = run_checker(toy.root)  # static + runtime
    assert proc.returncode == 0
    assert "OK" in proc.stdout


def test_allow_comment_needs_a_reason(toy, run_checker):
    path = toy.module(
        "beta",
        "mod.py",
        "def f(name):\n    return __import__(name)  # import-check: allow-dynamic  <-- HERE\n",
    )
    proc = run_checker(toy.root, "--static-only")
    assert proc.returncode == 1
    assert toy.loc(path) in proc.stdout


def test_allow_comment_does_not_excuse_a_forbidden_literal(toy, run_checker):
    path = toy.module(
        "beta",
        "mod.py",
        "import importlib\n\n"
        'importlib.import_module("gamma")  # import-check: allow-dynamic (no)  <-- HERE\n',
    )
    proc = run_checker(toy.root, "--static-only")
    assert proc.returncode == 1
    assert f"{toy.loc(path)} package beta imports forbidden gamma (dynamic literal)" in proc.stdout


def test_allowed_and_internal_imports_are_clean(toy, run_checker):
    toy.module("beta", "sub.py", "x = 1\n")
    toy.module(
        "beta",
        "mod.py",
        """\
        import importlib
        import importlib.util
        import json
        import os.path

        import alpha
        import alpha.util
        from alpha import util
        from alpha.util import helper

        from . import sub
        from .sub import x

        importlib.import_module("alpha.util")
        importlib.import_module(".sub", __package__)
        importlib.import_module(".sub", package="beta")
        importlib.util.find_spec("json")
        __import__("os")
        __import__("sub", globals(), None, [], 1)


        def load():
            from beta import sub as s

            return s, x, helper, util, alpha, json, os
        """,
    )
    proc = run_checker(toy.root)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.strip().endswith("OK (static + runtime; alpha, beta, gamma)")


def test_syntax_error_is_reported(toy, run_checker):
    path = toy.module("beta", "mod.py", "x = 1\ndef broken(:  # <-- HERE\n")
    proc = run_checker(toy.root, "--static-only")
    assert proc.returncode == 1
    assert toy.loc(path) in proc.stdout and "cannot parse" in proc.stdout


# --------------------------------------------------------------- runtime ---


def test_runtime_only_import_found_with_chain(toy, run_checker):
    """An import that happens only when a smoke entry point calls a function,
    with a name the static scan cannot see."""
    toy.module(
        "beta",
        "__init__.py",
        '__version__ = "1.0"\n__smoke__ = ["beta.smoke:run"]\n',
    )
    toy.module(
        "beta",
        "smoke.py",
        """\
        def run():
            from beta import helpers

            helpers.load()
        """,
    )
    helpers = toy.module(
        "beta",
        "helpers.py",
        """\
        import importlib


        def load():
            name = "".join(["gam", "ma", ".sub"])
            return importlib.import_module(name)  # import-check: allow-dynamic (test)  <-- HERE
        """,
    )
    static = run_checker(toy.root, "--static-only")
    assert static.returncode == 0

    proc = run_checker(toy.root)
    assert proc.returncode == 1
    expected = (
        f"{toy.loc(helpers)} package beta imports forbidden gamma "
        "(runtime, chain beta.smoke -> beta.helpers -> gamma) "
        "[during smoke entry point beta.smoke:run]"
    )
    assert expected in proc.stdout
    # only beta is guilty
    assert "package gamma" not in proc.stdout and "package alpha" not in proc.stdout


def test_runtime_without_smoke_imports_every_submodule(toy, run_checker):
    toy.module("beta", "deep/__init__.py", "")
    path = toy.module(
        "beta",
        "deep/plugin.py",
        """\
        import importlib

        _NAME = "gamma"[::-1][::-1]
        importlib.import_module(_NAME)  # import-check: allow-dynamic (test)  <-- HERE
        """,
    )
    proc = run_checker(toy.root)
    assert proc.returncode == 1
    expected = "package beta imports forbidden gamma (runtime, chain beta.deep.plugin -> gamma)"
    assert f"{toy.loc(path)} {expected}" in proc.stdout


def test_runtime_chain_through_an_allowed_package(toy, run_checker):
    """beta may import alpha; alpha (wrongly) loads gamma: both are reported,
    beta's finding shows the whole chain."""
    toy.module("beta", "__init__.py", "import alpha  # noqa\n")
    path = toy.module(
        "alpha",
        "__init__.py",
        """\
        import importlib

        importlib.import_module("".join("gamma"))  # import-check: allow-dynamic (test)  <-- HERE
        """,
    )
    proc = run_checker(toy.root)
    assert proc.returncode == 1
    expected = "package beta imports forbidden gamma (runtime, chain beta -> alpha -> gamma)"
    assert f"{toy.loc(path)} {expected}" in proc.stdout
    assert (
        f"{toy.loc(path)} package alpha imports forbidden gamma (runtime, chain alpha -> gamma)"
        in proc.stdout
    )


def test_smoke_entry_point_failure_fails_the_check(toy, run_checker):
    toy.module("beta", "__init__.py", '__smoke__ = ["beta.smoke:boom"]\n')
    path = toy.module(
        "beta", "smoke.py", "def boom():\n    raise RuntimeError('kaput')  # <-- HERE\n"
    )
    proc = run_checker(toy.root)
    assert proc.returncode == 1
    assert f"{toy.loc(path)} package beta: smoke entry point beta.smoke:boom failed" in proc.stdout
    assert "kaput" in proc.stdout


def test_package_option_restricts_the_check(toy, run_checker):
    toy.module("beta", "mod.py", "import gamma\n")
    assert run_checker(toy.root, "--package", "gamma", "--package", "alpha").returncode == 0
    proc = run_checker(toy.root, "--package", "beta-pkg")  # the directory name works too
    assert proc.returncode == 1
    assert "package beta imports forbidden gamma (static)" in proc.stdout
    assert "package beta imports forbidden gamma (runtime, chain beta.mod -> gamma)" in proc.stdout


def test_clean_tree_exits_0(toy, run_checker):
    toy.module("beta", "__init__.py", '__smoke__ = ["beta.api:main"]\n')
    toy.module(
        "beta", "api.py", "from alpha.util import helper\n\n\ndef main():\n    return helper()\n"
    )
    proc = run_checker(toy.root)
    assert proc.returncode == 0
    assert proc.stdout.strip() == "import-check: OK (static + runtime; alpha, beta, gamma)"


# -------------------------------------------------------- configuration ---


def _drop_pyproject(toy):
    (toy.root / "pyproject.toml").unlink()


def _bad_toml(toy):
    toy.write("pyproject.toml", "[tool.gdn-import-check\n")


def _no_table(toy):
    toy.write("pyproject.toml", "[tool.ruff]\nline-length = 100\n")


def _no_allowed(toy):
    toy.write("pyproject.toml", '[tool.gdn-import-check]\npackages-dir = "packages"\n')


def _unknown_in_allowed_list(toy):
    toy.write("pyproject.toml", TOY_CONFIG_WITH('beta = ["alpha", "delta"]'))


def _configured_package_missing(toy):
    toy.write("pyproject.toml", TOY_CONFIG_PLUS("delta = []"))


def _packages_dir_missing(toy):
    shutil.rmtree(toy.root / "packages")


def _package_not_in_config(toy):
    toy.module("delta", "__init__.py", "")


def _bad_value(toy):
    toy.write("pyproject.toml", TOY_CONFIG_WITH('beta = "alpha"'))


def _bad_smoke(toy):
    toy.module("beta", "__init__.py", "__smoke__ = ['beta.smoke']\n")


def _foreign_smoke(toy):
    toy.module("beta", "__init__.py", "__smoke__ = ['gamma.sub:thing']\n")


def TOY_CONFIG_WITH(beta_line: str) -> str:
    return TOY_CONFIG.replace('beta = ["alpha"]', beta_line)


def TOY_CONFIG_PLUS(line: str) -> str:
    return TOY_CONFIG + line + "\n"


MISCONFIG = {
    "no pyproject": _drop_pyproject,
    "invalid toml": _bad_toml,
    "no [tool.gdn-import-check]": _no_table,
    "no allowed table": _no_allowed,
    "unknown package in an allowed list": _unknown_in_allowed_list,
    "configured package has no directory": _configured_package_missing,
    "packages-dir missing": _packages_dir_missing,
    "package without config entry": _package_not_in_config,
    "allowed value not a list": _bad_value,
    "malformed __smoke__": _bad_smoke,
    "__smoke__ naming another package": _foreign_smoke,
}


@pytest.mark.parametrize("case", sorted(MISCONFIG))
def test_misconfiguration_exits_2(case, toy, run_checker):
    MISCONFIG[case](toy)
    proc = run_checker(toy.root)
    assert proc.returncode == 2
    assert "configuration error" in proc.stderr


def test_unknown_package_option_exits_2(toy, run_checker):
    proc = run_checker(toy.root, "--package", "nope")
    assert proc.returncode == 2
    assert "nope" in proc.stderr


# ---------------------------------------------------------- the real repo ---


def test_real_repo_is_clean(run_checker):
    proc = run_checker(REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _copy_repo(dst: Path) -> Path:
    dst.mkdir()
    shutil.copy2(REPO_ROOT / "pyproject.toml", dst / "pyproject.toml")
    shutil.copytree(
        REPO_ROOT / "packages",
        dst / "packages",
        ignore=shutil.ignore_patterns(
            "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache"
        ),
    )
    return dst


def test_real_repo_copy_with_forbidden_import_is_caught(tmp_path, run_checker):
    root = _copy_repo(tmp_path / "repo")
    init = root / "packages/gdn-det-train-kcp/src/gdn_det_train_kcp/__init__.py"
    text = init.read_text(encoding="utf-8")
    if not text.endswith("\n"):
        text += "\n"
    text += 'import importlib as _importlib\n\n_importlib.import_module("kda_det_train")\n'
    init.write_text(text, encoding="utf-8")
    line = len(text.splitlines())
    loc = f"packages/gdn-det-train-kcp/src/gdn_det_train_kcp/__init__.py:{line}:"

    proc = run_checker(root)
    assert proc.returncode == 1
    found = [ln for ln in proc.stdout.splitlines() if loc in ln]
    assert any(
        ln.endswith("package gdn_det_train_kcp imports forbidden kda_det_train (dynamic literal)")
        for ln in found
    ), proc.stdout
    assert any(
        "package gdn_det_train_kcp imports forbidden kda_det_train "
        "(runtime, chain gdn_det_train_kcp -> kda_det_train)" in ln
        for ln in found
    ), proc.stdout
    # nothing else of the repo is blamed
    assert all("gdn_det_train_kcp" in ln for ln in proc.stdout.splitlines() if ": package " in ln)
