"""Static check: no atomics reachable from a kernel declared atomic-free.

Every Triton launcher in this repo is declared with
``@launcher(uses_atomics=..., kernels=(kernel, ...))`` (see
``gdn_core.ops.registry``); the deterministic code paths may call only
launchers declared ``uses_atomics=False`` (a runtime test proves that with
``record_launches``). This tool proves the declarations true, from the source:

* for every launcher declared ``uses_atomics=False``, no ``tl.atomic_*`` call
  is reachable from its kernels through ``@triton.jit`` helper calls (a helper
  passed by name, e.g. a scan's combine function, counts as called, and so does a
  partition function named in ``gl.warp_specialize``'s list of ``(function, args)``);
* every ``@triton.jit`` kernel is either launched through a declared launcher
  or called by another ``@triton.jit`` function (nothing launches unchecked);
* Gluon kernels (``@gluon.jit``) count as ``@triton.jit`` ones, and their
  ``gl.atomic_*`` / ``ttgl.atomic_*`` calls as ``tl.atomic_*``;
* no ``triton.autotune`` decorates a kernel of an atomic-free launcher (the
  deterministic paths use pinned configurations);
* TileLang modules (those importing ``tilelang``; their kernels are built inside
  the launcher's module, not named by ``kernels=``): no ``T.atomic*`` call and no
  ``tilelang.autotune`` anywhere in a module that declares an atomic-free
  launcher.

Usage: ``python tools/check_kernel_determinism.py [--root DIR]`` (default: the
repo's ``packages/``). One line per finding (``file:line: message``); exit 1
on any finding, 0 when clean.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class JitFunction:
    name: str
    path: Path
    line: int
    calls: set[str] = field(default_factory=set)
    atomics: list[int] = field(default_factory=list)  # lines of tl.atomic_* calls
    autotuned: bool = False


@dataclass
class Launcher:
    name: str
    path: Path
    line: int
    uses_atomics: bool
    kernels: list[str]


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return f"{_decorator_name(target.value)}.{target.attr}"
    if isinstance(target, ast.Name):
        return target.id
    return ""


_TL_ATOMIC = ("T.atomic", "tilelang.language.atomic")
# Triton and Gluon kernels (``@gluon.jit``, the same checks) and their atomics: ``tl.`` /
# ``gl.`` / ``ttgl.`` aliases and the full module paths.
_JIT_DECORATORS = ("triton.jit", "jit", "gluon.jit", "triton.experimental.gluon.jit")
_JIT_ATOMICS = ("tl.atomic_", "triton.language.atomic_", "gl.atomic_", "ttgl.atomic_",
                "triton.experimental.gluon.language.atomic_")


def _tilelang_findings(path: Path, tree: ast.Module, launchers: list[Launcher]) -> list[str]:
    """Atomics and autotuning in a TileLang module with an atomic-free launcher."""
    if not any(ln.path == path and not ln.uses_atomics for ln in launchers):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = _decorator_name(node)
            if callee.startswith(_TL_ATOMIC):
                out.append(f"{path}:{node.lineno}: TileLang atomic {callee} in a module with an "
                           f"atomic-free launcher")
            elif callee.endswith("autotune") and "tilelang" in callee:
                out.append(f"{path}:{node.lineno}: tilelang.autotune in a module with an "
                           f"atomic-free launcher (pin the configuration)")
        elif isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:  # a bare decorator (a called one is a Call)
                name = "" if isinstance(dec, ast.Call) else _decorator_name(dec)
                if name.endswith("autotune") and "tilelang" in name:
                    out.append(f"{path}:{dec.lineno}: tilelang.autotune in a module with an "
                               f"atomic-free launcher (pin the configuration)")
    return out


def _imports_tilelang(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tilelang"
                                                for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tilelang":
            return True
    return False


def _scan_file(path: Path, jits: dict[str, JitFunction], launchers: list[Launcher]) -> ast.Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        names = [_decorator_name(d) for d in node.decorator_list]
        if any(n in _JIT_DECORATORS for n in names):
            fn = JitFunction(node.name, path, node.lineno,
                             autotuned=any(n.endswith("autotune") for n in names))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    callee = _decorator_name(sub)
                    if callee.startswith(_JIT_ATOMICS):
                        fn.atomics.append(sub.lineno)
                    elif "." not in callee:
                        fn.calls.add(callee)
                    # a function passed by name (a scan's or reduction's combine function)
                    # is reached as if called
                    fn.calls.update(a.id for a in sub.args if isinstance(a, ast.Name))
                    # gl.warp_specialize([(partition, (args...)), ...]): each partition
                    # function (the first element of a tuple in a list argument) is called
                    for a in sub.args:
                        if isinstance(a, ast.List):
                            fn.calls.update(e.elts[0].id for e in a.elts
                                            if isinstance(e, ast.Tuple) and e.elts
                                            and isinstance(e.elts[0], ast.Name))
            jits[f"{path}:{node.name}"] = fn
        for dec in node.decorator_list:
            if isinstance(dec, ast.Call) and _decorator_name(dec).endswith("launcher"):
                kw = {k.arg: k.value for k in dec.keywords}
                uses = kw.get("uses_atomics")
                if not isinstance(uses, ast.Constant) or not isinstance(uses.value, bool):
                    raise SystemExit(f"{path}:{dec.lineno}: launcher needs a literal uses_atomics")
                kernels = kw.get("kernels")
                names_ = []
                if isinstance(kernels, (ast.Tuple, ast.List)):
                    names_ = [e.id for e in kernels.elts if isinstance(e, ast.Name)]
                launchers.append(Launcher(node.name, path, node.lineno, uses.value, names_))
    return tree


def check(root: Path) -> list[str]:
    """All findings under ``root`` (each ``file:line: message``)."""
    jits: dict[str, JitFunction] = {}
    launchers: list[Launcher] = []
    tilelang_modules: list[tuple[Path, ast.Module]] = []
    for path in sorted(root.rglob("*.py")):
        if "tests" in path.parts:
            continue
        tree = _scan_file(path, jits, launchers)
        if _imports_tilelang(tree):
            tilelang_modules.append((path, tree))

    def resolve(path: Path, name: str) -> JitFunction | None:
        # Same module first, then any module (helpers imported by name).
        return jits.get(f"{path}:{name}") or next(
            (f for f in jits.values() if f.name == name), None)

    findings: list[str] = []
    for path, tree in tilelang_modules:
        findings += _tilelang_findings(path, tree, launchers)
    launched: set[str] = set()
    called: set[str] = set()
    for fn in jits.values():
        for callee in fn.calls:
            target = resolve(fn.path, callee)
            if target is not None:
                called.add(f"{target.path}:{target.name}")
    for ln in launchers:
        for kname in ln.kernels:
            kernel = resolve(ln.path, kname)
            if kernel is None:
                findings.append(f"{ln.path}:{ln.line}: launcher {ln.name} names kernel {kname}, "
                                f"which is not a @triton.jit function of this repo")
                continue
            launched.add(f"{kernel.path}:{kernel.name}")
            if ln.uses_atomics:
                continue
            if kernel.autotuned:
                findings.append(f"{kernel.path}:{kernel.line}: kernel {kernel.name} of atomic-free "
                                f"launcher {ln.name} is autotuned (pin its config)")
            seen, stack = set(), [(kernel, [kernel.name])]
            while stack:
                fn, chain = stack.pop()
                key = f"{fn.path}:{fn.name}"
                if key in seen:
                    continue
                seen.add(key)
                for line in fn.atomics:
                    findings.append(
                        f"{fn.path}:{line}: tl.atomic_* reachable from launcher {ln.name} "
                        f"declared uses_atomics=False (chain {' -> '.join(chain)})")
                for callee in sorted(fn.calls):
                    target = resolve(fn.path, callee)
                    if target is not None:
                        stack.append((target, [*chain, target.name]))
    for key, fn in sorted(jits.items()):
        if key not in launched and key not in called:
            findings.append(f"{fn.path}:{fn.line}: @triton.jit kernel {fn.name} is launched by no "
                            f"declared launcher (wrap its launcher with @launcher(...))")
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path,
                        default=Path(__file__).resolve().parent.parent / "packages")
    args = parser.parse_args(argv)
    findings = check(args.root)
    for line in findings:
        print(line)
    if not findings:
        print(f"kernel-determinism: OK ({args.root})")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
