"""Run the repository's test suites, each package's in its own pytest process.

Usage: ``python tools/run_all_tests.py [--only PACKAGE] [--gpu] [--jobs N]``.

Without ``--only`` it also runs ruff, the import-independence checker and the
cross-package tests in ``tests/``. Every suite runs even if an earlier one
failed; the exit status is non-zero if any failed, including a suite in which
pytest collected no tests (pytest exit code 5).

``--jobs N`` (default: the CPU count) runs up to N suites at once, each with one
intra-op thread (``OMP_NUM_THREADS=1`` unless set), its output printed whole when it
ends. On the CPU the interpreter-bound ``gdn-core`` suite is split into N shards of
whole test files (balanced by size) so that it does not run alone at the end. ``--jobs 1``
runs the suites one after another, streaming their output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [
    "gdn-core",
    "gdn-train",
    "gdn-det-train",
    "gdn-train-kcp",
    "gdn-det-train-kcp",
    "kda-det-train",
]
#: suites split into shards of whole test files when several run at once
SHARDED = ("gdn-core",)


def _run(name: str, cmd: list[str]) -> tuple[str, int, float]:
    """One suite in the foreground, its output streamed."""
    print(f"\n===== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    return name, rc, time.perf_counter() - start


def _run_captured(name: str, cmd: list[str], env: dict[str, str]) -> tuple[str, int, float]:
    """One suite beside others: its output captured and printed whole at its end."""
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as out:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        seconds = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    print(f"\n===== {name} ({seconds:.0f} s): {' '.join(cmd)}\n{text}", end="", flush=True)
    return name, rc, seconds


def _weight(f: Path) -> int:
    """A test file's expected share of a CPU run: its size, nothing for a ``*_gpu.py``
    file (every test there is ``gpu``-marked, deselected on the CPU)."""
    return 0 if f.stem.endswith("_gpu") else f.stat().st_size


def _shards(test_dir: Path, n: int) -> list[list[str]]:
    """The test files of ``test_dir`` in ``n`` groups of about equal :func:`_weight`
    (heaviest file first into the lightest group; a fixed split for a fixed tree)."""
    files = sorted(test_dir.glob("test_*.py"), key=lambda f: (-_weight(f), f.name))
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(n)]
    for f in files:
        i = min(range(n), key=lambda j: (groups[j][0], len(groups[j][1]), j))
        size, names = groups[i]
        groups[i] = (size + _weight(f), [*names, str(f.relative_to(ROOT))])
    return [sorted(names) for _, names in groups if names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=PACKAGES, help="run one package's suite only")
    parser.add_argument("--gpu", action="store_true", help="run the `gpu`-marked tests instead")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="suites run at once (default: the CPU count; 1: one at a time)")
    parser.add_argument("pytest_args", nargs="*", help="extra arguments passed to pytest")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")

    marker = "gpu" if args.gpu else "not gpu"
    pytest = [sys.executable, "-m", "pytest", "-q", "-m", marker, *args.pytest_args]
    packages = [args.only] if args.only else PACKAGES
    results = []
    if not args.only and not args.gpu:
        results.append(_run("ruff", [sys.executable, "-m", "ruff", "check", "."]))
        results.append(
            _run("import-check", [sys.executable, "tools/check_import_independence.py"])
        )
        results.append(
            _run("kernel-determinism", [sys.executable, "tools/check_kernel_determinism.py"])
        )
    suites: list[tuple[str, list[str]]] = []
    for package in packages:
        test_dir = ROOT / "packages" / package / "tests"
        if args.jobs > 1 and package in SHARDED and not args.gpu:
            shards = _shards(test_dir, args.jobs)
            suites += [(f"{package} [{i + 1}/{len(shards)}]", [*pytest, *files])
                       for i, files in enumerate(shards)]
        else:
            suites.append((package, [*pytest, f"packages/{package}/tests"]))
    if not args.only and not args.gpu:
        suites.append(("cross-package", [*pytest, "tests"]))
    if args.jobs == 1:
        results += [_run(name, cmd) for name, cmd in suites]
    else:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        print(f"\n===== {len(suites)} suites, {args.jobs} at a time", flush=True)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results += list(pool.map(lambda suite: _run_captured(*suite, env), suites))

    print("\n===== summary")
    for name, rc, seconds in results:
        status = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"{name:24s} {status:18s} {seconds:7.1f}s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
