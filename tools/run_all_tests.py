"""Run the repository's test suites, each package's in its own pytest process.

Usage: ``python tools/run_all_tests.py [--only PACKAGE] [--gpu]``.

Without ``--only`` it also runs ruff, the import-independence checker and the
cross-package tests in ``tests/``. Every suite runs even if an earlier one
failed; the exit status is non-zero if any failed, including a suite in which
pytest collected no tests (pytest exit code 5).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
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


def _run(name: str, cmd: list[str]) -> tuple[str, int, float]:
    print(f"\n===== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    return name, rc, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=PACKAGES, help="run one package's suite only")
    parser.add_argument("--gpu", action="store_true", help="run the `gpu`-marked tests instead")
    parser.add_argument("pytest_args", nargs="*", help="extra arguments passed to pytest")
    args = parser.parse_args()

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
    for package in packages:
        results.append(_run(package, [*pytest, f"packages/{package}/tests"]))
    if not args.only and not args.gpu:
        results.append(_run("cross-package", [*pytest, "tests"]))

    print("\n===== summary")
    for name, rc, seconds in results:
        status = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"{name:20s} {status:18s} {seconds:7.1f}s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
