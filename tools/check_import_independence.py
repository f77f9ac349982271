#!/usr/bin/env python3
"""Check that the repository's packages import only what they are allowed to.

The rule lives in the root ``pyproject.toml``::

    [tool.gdn-import-check]
    packages-dir = "packages"

    [tool.gdn-import-check.allowed]
    gdn_core = []
    gdn_train = ["gdn_core"]

A package (found as ``<packages-dir>/*/src/<import_name>``) may import itself,
the standard library and third-party modules, and of this repository's
packages (the keys of ``allowed``) only those listed for it.

Two checks run:

* **static** -- the AST of every ``.py`` file of every package: ``import x``,
  ``from x import y``, relative imports (resolved; one that climbs out of its
  package and lands on another repo package is reported), and the literal
  module names given to ``importlib.import_module`` (with a literal
  ``package=`` for relative names), ``__import__`` and
  ``importlib.util.find_spec``.  A dynamic import whose name is not a literal
  is itself reported unless its line carries
  ``# import-check: allow-dynamic (<reason>)``.
* **runtime** -- per package, a fresh interpreter with the ``src`` dirs of
  *all* repo packages on ``sys.path`` (so a forbidden import succeeds and can
  be seen) installs an import hook recording every module loaded and the
  module that loaded it, imports the package and runs its smoke entry points:
  the module-level ``__smoke__ = ["module:function", ...]`` of its
  ``__init__.py`` (read from the AST; the functions are called without
  arguments), or, without ``__smoke__``, imports every submodule.  Any
  forbidden repo module left in ``sys.modules`` is reported with the chain of
  modules that loaded it.  At run time a package may also load what its
  allowed packages are allowed to load (the transitive closure).

Output: one line per finding, ``file:line: package X imports forbidden Y
(kind)``.  Exit status: 0 clean, 1 findings (or a smoke entry point that
failed), 2 misconfiguration.

Usage: ``python tools/check_import_independence.py [--root PATH]
[--static-only] [--package NAME ...]``.  Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import tokenize
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_ROOT = Path(__file__).resolve().parent.parent
ALLOW_DYNAMIC_RE = re.compile(r"#\s*import-check:\s*allow-dynamic\s*\(\s*[^)\s][^)]*\)")
ALLOW_HINT = "# import-check: allow-dynamic (<reason>)"
DEFAULT_TIMEOUT_S = 300.0

EXIT_OK, EXIT_FINDINGS, EXIT_CONFIG = 0, 1, 2


class ConfigError(Exception):
    """The checker's configuration (or a package's ``__smoke__``) is unusable."""


# --------------------------------------------------------------- config ---


@dataclass(frozen=True)
class Package:
    name: str  # import name, e.g. "gdn_core"
    dist_dir: Path  # packages/gdn-core
    src_dir: Path  # packages/gdn-core/src (what goes on sys.path)

    @property
    def pkg_dir(self) -> Path:
        return self.src_dir / self.name

    @property
    def init_file(self) -> Path:
        return self.pkg_dir / "__init__.py"


@dataclass
class Config:
    root: Path
    packages: dict[str, Package]  # import name -> package, every repo package
    allowed: dict[str, frozenset[str]]  # import name -> repo packages it may import

    def forbidden_static(self, pkg: str, target: str) -> bool:
        top = target.split(".", 1)[0]
        return top in self.packages and top != pkg and top not in self.allowed[pkg]

    def runtime_allowed(self, pkg: str) -> set[str]:
        seen = {pkg}
        todo = [pkg]
        while todo:
            for dep in self.allowed[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen


def load_config(root: Path) -> Config:
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        raise ConfigError(f"{pyproject} not found")
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{pyproject}: invalid TOML: {exc}") from exc
    table = data.get("tool", {}).get("gdn-import-check")
    if not isinstance(table, dict):
        raise ConfigError(f"{pyproject}: no [tool.gdn-import-check] table")
    packages_dir = table.get("packages-dir")
    if not isinstance(packages_dir, str) or not packages_dir:
        raise ConfigError(f"{pyproject}: [tool.gdn-import-check] packages-dir must be a string")
    raw_allowed = table.get("allowed")
    if not isinstance(raw_allowed, dict) or not raw_allowed:
        raise ConfigError(f"{pyproject}: no [tool.gdn-import-check.allowed] table")
    for key, value in raw_allowed.items():
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"{pyproject}: [tool.gdn-import-check.allowed] {key} must be a list of strings"
            )
    for key, value in raw_allowed.items():
        for dep in value:
            if dep not in raw_allowed:
                raise ConfigError(
                    f"{pyproject}: [tool.gdn-import-check.allowed] {key} lists {dep!r}, "
                    "which is not a package of the config"
                )

    pdir = (root / packages_dir).resolve()
    if not pdir.is_dir():
        raise ConfigError(f"packages-dir {pdir} does not exist")
    found: dict[str, Package] = {}
    for dist_dir in sorted(p for p in pdir.iterdir() if p.is_dir()):
        src = dist_dir / "src"
        if not src.is_dir():
            continue
        for cand in sorted(src.iterdir()):
            if not (cand.is_dir() and cand.name.isidentifier()):
                continue
            if not (cand / "__init__.py").is_file():
                continue
            if cand.name in found:
                raise ConfigError(
                    f"import name {cand.name!r} is provided by both "
                    f"{found[cand.name].dist_dir} and {dist_dir}"
                )
            found[cand.name] = Package(cand.name, dist_dir, src)
    for key in raw_allowed:
        if key not in found:
            raise ConfigError(
                f"{pyproject}: package {key!r} of [tool.gdn-import-check.allowed] not found "
                f"as {pdir}/*/src/{key}/__init__.py"
            )
    for name, pkg in found.items():
        if name not in raw_allowed:
            raise ConfigError(
                f"{pkg.pkg_dir}: package {name!r} has no entry in [tool.gdn-import-check.allowed]"
            )
    allowed = {k: frozenset(v) for k, v in raw_allowed.items()}
    return Config(root=root, packages=found, allowed=allowed)


# ------------------------------------------------------------- findings ---


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    message: str

    def render(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def show_path(path: Path | str) -> str:
    """Path relative to the working directory when below it, else absolute."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(p)


def package_files(pkg: Package) -> Iterator[Path]:
    for path in sorted(pkg.pkg_dir.rglob("*.py")):
        rel = path.relative_to(pkg.src_dir)
        if "__pycache__" in rel.parts:
            continue
        yield path


def module_name_of(pkg: Package, path: Path) -> tuple[str, bool]:
    """(dotted module name, is_package) of a file below ``pkg.src_dir``."""
    parts = list(path.relative_to(pkg.src_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


# --------------------------------------------------------- static check ---

# call target (after alias resolution) -> kind of dynamic import
DYNAMIC_CALLS = {
    "importlib.import_module": "import_module",
    "importlib.util.find_spec": "find_spec",
    "importlib.__import__": "__import__",
    "builtins.__import__": "__import__",
}


def resolve_relative(name: str, package: str) -> str:
    """importlib's relative-name resolution, except that a name which climbs
    out of the top-level package resolves to top-level names (it is an
    ImportError at run time, but it names a sibling package all the same)."""
    level = len(name) - len(name.lstrip("."))
    rest = name[level:]
    base = package.split(".") if package else []
    keep = len(base) - (level - 1)
    base = base[: max(keep, 0)]
    return ".".join([*base, rest] if rest else base)


class _Scanner:
    def __init__(self, cfg: Config, pkg: Package, path: Path, source: str, tree: ast.Module):
        self.cfg = cfg
        self.pkg = pkg
        self.path = path
        self.shown = show_path(path)
        self.module, self.is_package = module_name_of(pkg, path)
        self.package = self.module if self.is_package else self.module.rpartition(".")[0]
        self.tree = tree
        self.comments = _comments_by_line(source)
        self.aliases = self._collect_aliases()
        self.findings: list[Finding] = []

    # -- helpers
    def _collect_aliases(self) -> dict[str, str]:
        aliases: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".", 1)[0]
                        aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    if a.name != "*":
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        return aliases

    def _qualname(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            if node.id == "__import__" and node.id not in self.aliases:
                return "builtins.__import__"
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self._qualname(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def _const_str(self, node: ast.expr | None) -> str | None:
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            parts = [self._const_str(v) for v in node.values]
            return None if any(p is None for p in parts) else "".join(parts)  # type: ignore[arg-type]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self._const_str(node.left), self._const_str(node.right)
            return None if left is None or right is None else left + right
        if isinstance(node, ast.Name) and node.id == "__name__":
            return self.module
        if isinstance(node, ast.Name) and node.id == "__package__":
            return self.package
        return None

    def _allowed_dynamic(self, node: ast.AST) -> bool:
        first = node.lineno
        last = getattr(node, "end_lineno", None) or first
        return any(
            ALLOW_DYNAMIC_RE.search(self.comments.get(n, "")) for n in range(first, last + 1)
        )

    def _report(self, node: ast.AST, target: str, kind: str) -> None:
        self.findings.append(
            Finding(
                self.shown,
                node.lineno,
                f"package {self.pkg.name} imports forbidden {target} ({kind})",
            )
        )

    def _check(self, node: ast.AST, target: str, kind: str) -> None:
        if target and self.cfg.forbidden_static(self.pkg.name, target):
            self._report(node, target, kind)

    # -- the scan
    def run(self) -> list[Finding]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self._check(node, a.name, "static")
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)
            elif isinstance(node, ast.Call):
                self._call(node)
        return self.findings

    def _import_from(self, node: ast.ImportFrom) -> None:
        if node.level == 0:
            if node.module:
                self._check(node, node.module, "static")
            return
        base = resolve_relative("." * node.level + (node.module or ""), self.package)
        if node.module:
            self._check(node, base, "static")
        else:
            for a in node.names:
                if a.name != "*":
                    self._check(node, f"{base}.{a.name}" if base else a.name, "static")

    def _call(self, node: ast.Call) -> None:
        qual = self._qualname(node.func)
        kind = DYNAMIC_CALLS.get(qual or "")
        if kind is None:
            return
        if kind == "__import__":
            targets = self._dunder_import_targets(node)
        else:
            name = _arg(node, 0, "name")
            pkg_node = _arg(node, 1, "package")
            targets = None
            name_s = self._const_str(name)
            if name_s is not None:
                if not name_s.startswith("."):
                    targets = [name_s]
                elif pkg_node is not None:
                    package = self._const_str(pkg_node)
                    if package is not None:
                        targets = [resolve_relative(name_s, package)]
        if targets is None:
            if not self._allowed_dynamic(node):
                call = ast.unparse(node.func)
                args = ", ".join(ast.unparse(a) for a in node.args)
                self.findings.append(
                    Finding(
                        self.shown,
                        node.lineno,
                        f"package {self.pkg.name} imports forbidden <non-literal: "
                        f"{call}({args})> (dynamic non-literal)",
                    )
                )
            return
        for target in targets:
            self._check(node, target, "dynamic literal")

    def _dunder_import_targets(self, node: ast.Call) -> list[str] | None:
        name = self._const_str(_arg(node, 0, "name"))
        if name is None:
            return None
        level_node = _arg(node, 4, "level")
        level = 0
        if level_node is not None:
            if not (isinstance(level_node, ast.Constant) and isinstance(level_node.value, int)):
                return None
            level = level_node.value
        if level == 0:
            return [name]
        base = resolve_relative("." * level + name, self.package)
        if name:
            return [base]
        fromlist = _arg(node, 3, "fromlist")
        if isinstance(fromlist, (ast.List, ast.Tuple)):
            items = [self._const_str(e) for e in fromlist.elts]
            if all(i is not None for i in items):
                return [f"{base}.{i}" if base else i for i in items if i != "*"]  # type: ignore[misc]
            return None
        return [base]


def _arg(call: ast.Call, pos: int, kw: str) -> ast.expr | None:
    if len(call.args) > pos and not any(isinstance(a, ast.Starred) for a in call.args[: pos + 1]):
        return call.args[pos]
    for k in call.keywords:
        if k.arg == kw:
            return k.value
    return None


def _comments_by_line(source: str) -> dict[int, str]:
    out: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = out.get(tok.start[0], "") + tok.string
    except (tokenize.TokenError, SyntaxError):
        for n, line in enumerate(source.splitlines(), 1):
            if "#" in line:
                out[n] = line[line.index("#") :]
    return out


def static_check(cfg: Config, pkg: Package) -> list[Finding]:
    findings: list[Finding] = []
    for path in package_files(pkg):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
            line = getattr(exc, "lineno", None) or 1
            findings.append(
                Finding(show_path(path), line, f"package {pkg.name}: cannot parse: {exc}")
            )
            continue
        findings.extend(_Scanner(cfg, pkg, path, source, tree).run())
    return findings


def read_smoke(pkg: Package) -> list[str] | None:
    """The package's ``__smoke__`` list, read from its ``__init__.py`` AST."""
    tree = ast.parse(pkg.init_file.read_text(encoding="utf-8"), filename=str(pkg.init_file))
    value: ast.expr | None = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__smoke__" for t in node.targets
        ):
            value = node.value
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "__smoke__"
        ):
            value = node.value
    if value is None:
        return None
    where = f"{pkg.init_file}:{value.lineno}"
    if not isinstance(value, (ast.List, ast.Tuple)):
        raise ConfigError(f"{where}: __smoke__ must be a literal list of 'module:function'")
    entries = []
    for elt in value.elts:
        if not (isinstance(elt, ast.Constant) and isinstance(elt.value, str)):
            raise ConfigError(f"{where}: __smoke__ entries must be string literals")
        mod, sep, func = elt.value.partition(":")
        if (
            not sep
            or not all(p.isidentifier() for p in mod.split("."))
            or not all(p.isidentifier() for p in func.split("."))
        ):
            raise ConfigError(
                f"{where}: bad __smoke__ entry {elt.value!r} (want 'module:function')"
            )
        if mod != pkg.name and not mod.startswith(pkg.name + "."):
            raise ConfigError(
                f"{where}: __smoke__ entry {elt.value!r} is not a module of {pkg.name}"
            )
        entries.append(elt.value)
    return entries


def all_submodules(pkg: Package) -> list[str]:
    mods = []
    for path in package_files(pkg):
        rel = path.relative_to(pkg.src_dir).with_suffix("")
        if not all(p.isidentifier() for p in rel.parts) or rel.name == "__main__":
            continue
        name, _ = module_name_of(pkg, path)
        mods.append(name)
    return mods


# -------------------------------------------------------- runtime check ---

# Runs in the fresh interpreter: ``python -c PROBE config.json result.json``.
PROBE = r"""
import json, os, sys, traceback
cfg = json.load(open(sys.argv[1], encoding="utf-8"))
sys.dont_write_bytecode = True
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
sys.path[0:0] = cfg["paths"]
import importlib
_IMPORTLIB_DIR = os.path.dirname(importlib.__file__) + os.sep
_records = {}
_phase = ["startup"]

class _ImportRecorder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        try:
            f = sys._getframe(1)
            while f is not None:
                fn = f.f_code.co_filename
                if fn.startswith("<frozen importlib") or fn.startswith(_IMPORTLIB_DIR):
                    f = f.f_back
                    continue
                break
            if f is None:
                _records[fullname] = [None, None, None, _phase[0]]
            else:
                importer = f.f_globals.get("__name__")
                if importer == "__main__":
                    importer = None
                _records[fullname] = [importer, fn, f.f_lineno, _phase[0]]
        except Exception:
            pass
        return None

    @classmethod
    def invalidate_caches(cls):
        pass

sys.meta_path.insert(0, _ImportRecorder)
errors = []

def _attempt(phase, fn):
    _phase[0] = phase
    try:
        fn()
        return True
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.extract_tb(exc.__traceback__)
        frames = [[fr.filename, fr.lineno] for fr in tb]
        msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        errors.append({"phase": phase, "error": msg, "frames": frames})
        return False

def _smoke(entry):
    mod, _, func = entry.partition(":")
    obj = importlib.import_module(mod)
    for part in func.split("."):
        obj = getattr(obj, part)
    obj()

if _attempt("import " + cfg["package"], lambda: importlib.import_module(cfg["package"])):
    if cfg["smoke"] is not None:
        for entry in cfg["smoke"]:
            _attempt("smoke entry point " + entry, lambda e=entry: _smoke(e))
    else:
        for mod in cfg["submodules"]:
            _attempt("import " + mod, lambda m=mod: importlib.import_module(m))
_phase[0] = "end"
mods = list(sys.modules)
result = {
    "modules": mods,
    "records": {m: _records[m] for m in mods if m in _records},
    "errors": errors,
}
with open(sys.argv[2], "w", encoding="utf-8") as fh:
    json.dump(result, fh)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _location(cfg: Config, pkg: Package, file: str | None, line: int | None) -> tuple[str, int]:
    if file and line and os.path.isfile(file):
        return show_path(file), int(line)
    return show_path(pkg.init_file), 1


def _chain(records: dict[str, list], module: str) -> list[str]:
    chain = [module]
    seen = {module}
    cur = module
    while True:
        rec = records.get(cur)
        if not rec or not rec[0] or rec[0] in seen:
            break
        cur = rec[0]
        seen.add(cur)
        chain.append(cur)
    return chain[::-1]


def runtime_check(
    cfg: Config, pkg: Package, smoke: list[str] | None, timeout: float
) -> list[Finding]:
    others = [p.src_dir for n, p in sorted(cfg.packages.items()) if n != pkg.name]
    paths = list(dict.fromkeys(str(p) for p in [pkg.src_dir, *others]))
    probe_cfg = {
        "package": pkg.name,
        "paths": paths,
        "smoke": smoke,
        "submodules": all_submodules(pkg) if smoke is None else [],
    }
    with tempfile.TemporaryDirectory(prefix="import-check-") as tmp:
        cfg_file = Path(tmp, "config.json")
        out_file = Path(tmp, "result.json")
        cfg_file.write_text(json.dumps(probe_cfg), encoding="utf-8")
        where = show_path(pkg.init_file)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", PROBE, str(cfg_file), str(out_file)],
                cwd=tmp,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return [
                Finding(
                    where, 1, f"package {pkg.name}: runtime check timed out after {timeout:g} s"
                )
            ]
        if not out_file.is_file():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            detail = " | ".join(tail) or f"exit status {proc.returncode}"
            return [Finding(where, 1, f"package {pkg.name}: runtime check crashed: {detail}")]
        result = json.loads(out_file.read_text(encoding="utf-8"))

    findings: list[Finding] = []
    src_prefix = str(pkg.src_dir.resolve()) + os.sep
    for err in result["errors"]:
        frames = [f for f in err["frames"] if str(Path(f[0]).resolve()).startswith(src_prefix)]
        file, line = frames[-1] if frames else (None, None)
        path, line = _location(cfg, pkg, file, line)
        findings.append(
            Finding(path, line, f"package {pkg.name}: {err['phase']} failed: {err['error']}")
        )

    records: dict[str, list] = result["records"]
    ok = cfg.runtime_allowed(pkg.name)
    forbidden = set(cfg.packages) - ok
    entries: dict[tuple, str] = {}
    for mod in result["modules"]:
        top = mod.split(".", 1)[0]
        if top not in forbidden:
            continue
        rec = records.get(mod)
        importer = rec[0] if rec else None
        if importer and importer.split(".", 1)[0] == top:
            continue  # loaded from inside the forbidden package: not an entry point
        key = (top, importer, rec[1] if rec else None, rec[2] if rec else None)
        if key not in entries or len(mod) < len(entries[key]):
            entries[key] = mod
    for (_top, _importer, file, line), mod in entries.items():
        rec = records.get(mod)
        path, line = _location(cfg, pkg, file, line)
        if rec is None:
            how = "runtime, chain unknown: not loaded through the import system"
            phase = ""
        else:
            how = "runtime, chain " + " -> ".join(_chain(records, mod))
            phase = f" [during {rec[3]}]"
        findings.append(
            Finding(path, line, f"package {pkg.name} imports forbidden {mod} ({how}){phase}")
        )
    return findings


# ----------------------------------------------------------------- main ---


def select_packages(cfg: Config, names: Iterable[str]) -> list[Package]:
    names = list(names)
    if not names:
        return [cfg.packages[n] for n in sorted(cfg.packages)]
    by_dist = {p.dist_dir.name: p for p in cfg.packages.values()}
    out = []
    for n in names:
        pkg = cfg.packages.get(n) or by_dist.get(n)
        if pkg is None:
            raise ConfigError(f"--package {n!r}: no such package (known: {sorted(cfg.packages)})")
        if pkg not in out:
            out.append(pkg)
    return out


def run(root: Path, names: Iterable[str], static_only: bool, timeout: float) -> int:
    try:
        cfg = load_config(root.resolve())
        selected = select_packages(cfg, names)
        smokes = {pkg.name: read_smoke(pkg) for pkg in selected}
    except ConfigError as exc:
        print(f"import-check: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (OSError, SyntaxError) as exc:
        print(f"import-check: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    findings: list[Finding] = []
    futures = []
    pool = None
    if not static_only:
        workers = max(1, min(len(selected), max(2, os.cpu_count() or 2)))
        pool = ThreadPoolExecutor(max_workers=workers)
        futures = [
            pool.submit(runtime_check, cfg, pkg, smokes[pkg.name], timeout) for pkg in selected
        ]
    try:
        for pkg in selected:
            findings.extend(static_check(cfg, pkg))
        for fut in futures:
            findings.extend(fut.result())
    finally:
        if pool is not None:
            pool.shutdown(wait=True)

    unique = sorted(set(findings))
    for f in unique:
        print(f.render())
    mode = "static" if static_only else "static + runtime"
    checked = ", ".join(p.name for p in selected)
    if unique:
        if any("(dynamic non-literal)" in f.message for f in unique):
            print(f"import-check: mark an intended dynamic import with '{ALLOW_HINT}'")
        print(f"import-check: {len(unique)} finding(s) ({mode}; {checked})")
        return EXIT_FINDINGS
    print(f"import-check: OK ({mode}; {checked})")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check the import-independence rules of the repository's packages."
    )
    parser.add_argument(
        "--root", type=Path, default=DEFAULT_ROOT, help="repository root (default: %(default)s)"
    )
    parser.add_argument("--static-only", action="store_true", help="skip the runtime check")
    parser.add_argument(
        "--package",
        action="append",
        default=[],
        metavar="NAME",
        help="check only this package (import or directory name); repeatable",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds allowed per package's runtime check (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    return run(args.root, args.package, args.static_only, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
