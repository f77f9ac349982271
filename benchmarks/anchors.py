"""The speed anchors of ``bench_gdn_train.py``: fla and FlashQLA, each in its own process.

fla (``fla-core``) dispatches ``chunk_gated_delta_rule`` through a backend
registry (``fla/backends.py``): before its own Triton code it tries every
registered backend that is *available* (the backend's package is found by
``importlib.util.find_spec``) and *enabled* (its environment variable is not
``"0"``). For GDN that is FlashQLA (``fla/ops/gated_delta_rule/backends/
flash_qla.py``: package ``flash_qla``, switch ``FLA_FLASH_QLA``, called with
``auto_cp=True``); for the backward's dq/dk/dw/dg kernel on Hopper with
Triton >= 3.4 it is TileLang (``fla/ops/common/backends/tilelang``: package
``tilelang``, switch ``FLA_TILELANG``). So which kernels "fla" runs depends on
what else is importable in the process. Each anchor arm therefore runs in a
process of its own, with the modules it must not see blocked from import (a
meta-path finder that raises ``ModuleNotFoundError``, installed before fla is
imported, plus fla's switches set to ``0``), and reports afterwards which path
ran: fla's backend log of every dispatch and rejection, and which of
``flash_qla`` / ``tilelang`` got imported.

FlashQLA (``flash_qla.chunk_gated_delta_rule``) splits long documents across
SMs by default ("auto intra-card CP", ``auto_cp=True``): each piece's entry
state is rebuilt from warm-up chunks of the piece before it until their summed
decay is below -10, an approximation. ``auto_cp=False`` turns the split off
(exact). Whether the split ran, and into how many pieces, is read from the
context FlashQLA builds (``build_cp_context`` in
``flash_qla/ops/gated_delta_rule/chunk/__init__.py``), wrapped for one probe
call per shape.

The parent process talks to each arm's process over stdin/stdout: the child
loads its arm and prints one status line (:data:`STATUS_MARKER` + JSON), then
waits for ``go`` (run, write the JSON report, exit) or ``quit``. Nothing is
timed before every arm has loaded. A child whose parent dies (stdin closed)
exits at once, so a benchmark killed by a time limit leaves nothing running
on the GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any

STATUS_MARKER = "BENCH-ARM-STATUS "

# Distributions whose versions every report records (None = not installed).
ANCHOR_DISTS = ("fla-core", "flash-qla", "tilelang", "apache-tvm-ffi", "torch-c-dlpack-ext",
                "z3-solver", "einops")
WATCHED_MODULES = ("fla", "flash_qla", "tilelang")


def anchor_versions() -> dict[str, str | None]:
    """Installed versions of the anchors and their dependencies (without importing them)."""
    out: dict[str, str | None] = {}
    for dist in ANCHOR_DISTS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def importable(name: str) -> bool:
    """Whether ``name`` can be found on this process's path (nothing is imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def imported_modules() -> dict[str, bool]:
    """Which of fla, flash_qla, tilelang this process has imported so far."""
    return {name: name in sys.modules for name in WATCHED_MODULES}


# ------------------------------------------------------- import blocking ---


class ImportBlocker(importlib.abc.MetaPathFinder):
    """A meta-path finder that makes the given top-level packages unimportable.

    It raises ``ModuleNotFoundError`` with ``name`` set to the package, which is
    what fla's ``find_spec_cached`` treats as "not installed", and what
    ``import`` reports as such.
    """

    def __init__(self, names: tuple[str, ...]):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib API
        top = fullname.partition(".")[0]
        if top in self.names:
            raise ModuleNotFoundError(
                f"{top!r} is blocked from import in this benchmark process "
                "(bench_gdn_train.py: this arm must not see it)", name=top)
        return None


def block_imports(names: tuple[str, ...]) -> ImportBlocker | None:
    """Install an :class:`ImportBlocker` first on ``sys.meta_path``.

    Refuses (``RuntimeError``) if one of the packages is already imported: the
    block has to come before anything that could import it.
    """
    if not names:
        return None
    already = [n for n in names if any(m == n or m.startswith(n + ".") for m in sys.modules)]
    if already:
        raise RuntimeError(f"cannot block {', '.join(already)}: already imported in this process")
    blocker = ImportBlocker(names)
    sys.meta_path.insert(0, blocker)
    importlib.invalidate_caches()
    return blocker


# --------------------------------------------------- which path fla took ---


class FlaDispatchRecorder:
    """Collects fla's backend-dispatch log (``fla.backends``, level INFO).

    fla logs every dispatch (``[FLA Backend] op.fn -> backend``) and every
    rejection with its reason, once per key per process; :meth:`begin` forgets
    those keys so that each probe call logs its own decisions again.
    """

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._handler = logging.Handler(level=logging.INFO)
        self._handler.emit = lambda record: self.messages.append(record.getMessage())
        self._logger = logging.getLogger("fla.backends")
        self._logger.addHandler(self._handler)
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
        self._logger.propagate = False  # keep stderr free of fla's INFO lines

    def begin(self) -> None:
        self.messages.clear()
        backends = sys.modules.get("fla.backends")
        for attr in ("_operation_registries", "_function_registries"):
            for registry in getattr(backends, attr, {}).values():
                logged = getattr(registry, "_logged", None)
                if isinstance(logged, set):
                    logged.clear()

    def end(self) -> list[str]:
        return [m.replace("[FLA Backend] ", "") for m in self.messages]


def describe_fla_path(messages: list[str], flashqla: dict[str, Any] | None) -> str:
    """One line: which implementation fla's ``chunk_gated_delta_rule`` ran.

    ``flashqla`` is what the FlashQLA hook saw during the same call: not None
    means FlashQLA ran, whatever fla's log says.
    """
    taken = [m for m in messages if "rejected" not in m]
    gdn = [m for m in taken if ".chunk_gated_delta_rule ->" in m]
    if gdn or flashqla is not None:
        backend = gdn[0].rsplit("->", 1)[1].strip() if gdn else "flash_qla (seen by its hook)"
        text = f"fla dispatched to {backend}"
        if flashqla is not None:
            text += f" ({flashqla['mode']})"
        return text
    others = [m.rsplit(".", 1)[-1] for m in taken]
    text = "fla's own Triton kernels"
    if others:
        text += " + " + ", ".join(others)
    rejected = [m.split("->", 1)[1].strip() for m in messages
                if "rejected" in m and ".chunk_gated_delta_rule ->" in m]
    if rejected:
        text += " (" + "; ".join(rejected) + ")"
    return text


# ---------------------------------------------- which mode FlashQLA took ---

FLASHQLA_CHUNK_MODULE = "flash_qla.ops.gated_delta_rule.chunk"


class FlashQLAModeRecorder:
    """Records the CP contexts FlashQLA builds while a probe call runs.

    ``flash_qla.ops.gated_delta_rule.chunk._auto_intra_cp_context`` builds the
    context of every call through the module-level ``build_cp_context``; it
    is wrapped between :meth:`begin` and :meth:`end` only (never while timing).
    """

    def __init__(self) -> None:
        self.module = importlib.import_module(FLASHQLA_CHUNK_MODULE)  # ImportError: no FlashQLA
        # Missing in another FlashQLA version: the arm still runs, its mode is "unknown".
        self.original = getattr(self.module, "build_cp_context", None)
        self.contexts: list[Any] = []
        self.calls: list[dict[str, Any]] = []

    def begin(self) -> None:
        self.contexts.clear()
        self.calls.clear()
        if self.original is None:
            return

        def recording(*args, **kwargs):
            ctx = self.original(*args, **kwargs)
            self.contexts.append(ctx)
            self.calls.append({"enable_intra": kwargs.get("enable_intra"),
                               "is_train": kwargs.get("is_train")})
            return ctx

        self.module.build_cp_context = recording

    def end(self) -> dict[str, Any] | None:
        if self.original is None:
            return None
        self.module.build_cp_context = self.original
        if not self.contexts:
            return None
        try:
            return describe_flashqla_context(self.contexts[0], self.calls[0])
        except Exception as exc:  # noqa: BLE001 - a changed context class: say so, keep timing
            return {"mode": f"unknown ({type(exc).__name__}: {exc})", "exact": None}


def describe_flashqla_context(ctx: Any, call: dict[str, Any]) -> dict[str, Any]:
    """``{"mode": text, "exact": bool, ...}`` for one FlashQLA CP context."""
    def count(t: Any) -> int | None:
        return None if t is None else int(t.numel()) - 1

    docs = count(getattr(ctx, "cu_seqlens", None))
    out: dict[str, Any] = {"auto_cp_considered": bool(call.get("enable_intra")),
                           "is_train": call.get("is_train"),
                           "is_intra": bool(getattr(ctx, "is_intra", False)),
                           "sequences": docs}
    if out["is_intra"]:
        pieces = count(ctx.intra_cp_cu_seqlens)
        out.update(pieces=pieces, exact=False,
                   mode=f"auto intra-card CP split ON: {docs} sequence(s) -> {pieces} pieces "
                        "(approximate: warm-up entry states)")
    elif out["auto_cp_considered"]:
        out.update(exact=True, mode="auto intra-card CP considered, no split chosen (exact)")
    else:
        out.update(exact=True, mode="no intra-card CP (auto_cp=False or B > 1; exact)")
    return out


# ------------------------------------------------------ parent <-> child ---


def send_status(payload: dict[str, Any]) -> None:
    """Child: the one status line the parent waits for."""
    sys.stdout.write(STATUS_MARKER + json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()


def wait_for_go() -> bool:
    """Child: block until the parent says ``go`` (True) or ``quit`` / closes stdin (False).

    After ``go``, a daemon thread keeps reading stdin: when the parent dies the
    pipe closes and this process exits at once.
    """
    line = sys.stdin.readline()
    if line.strip() != "go":
        return False

    def watch() -> None:
        sys.stdin.read()
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    return True


class ArmProcess:
    """Parent side: one anchor arm's process."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.name = name
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=env,
            text=True, bufsize=1,
        )
        self.status: dict[str, Any] | None = None

    def read_status(self) -> dict[str, Any]:
        """Wait for the child's status line (other stdout lines go to stderr)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(STATUS_MARKER):
                self.status = json.loads(line[len(STATUS_MARKER):])
                return self.status
            sys.stderr.write(f"[{self.name}] {line}")
        rc = self.proc.wait()
        self.status = {"ok": False, "reason": f"its process exited (rc {rc}) before loading"}
        return self.status

    def run(self) -> int:
        """Tell the child to go and wait for it; its stdout is passed to stderr."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            sys.stderr.write(f"[{self.name}] {line}")
        rc = self.proc.wait()
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        return rc

    def quit(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
