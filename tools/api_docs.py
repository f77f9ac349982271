"""Build the API reference from the docstrings with pdoc: ``python tools/api_docs.py [OUT]``.

Every module of every package (pdoc alone follows ``__all__`` and would skip the
submodules a package does not re-export). Writes HTML to ``OUT`` (default
``docs/api``); ``hatch run api-docs`` runs it.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

PACKAGES = ["gdn_core", "gdn_train", "gdn_det_train", "gdn_train_kcp", "gdn_det_train_kcp",
            "kda_det_train"]


def modules() -> list[str]:
    """Every package and module name under :data:`PACKAGES`, in order."""
    names = []
    for package in PACKAGES:
        names.append(package)
        path = importlib.import_module(package).__path__
        names += sorted(m.name for m in pkgutil.walk_packages(path, prefix=package + "."))
    return names


def main(argv: list[str]) -> int:
    import pdoc

    out = Path(argv[0] if argv else "docs/api")
    pdoc.pdoc(*modules(), output_directory=out)
    print(f"API reference: {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
